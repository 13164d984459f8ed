"""What the student-scoring bench scripts (excess_by_entropy.py, layer_swap.py) share: a teacher and its student
from their CMF files, checked to belong together, and the texts to score them on: the held-out rows of windows.h5
and each out-of-domain source cut into windows of the same length."""

from __future__ import annotations

import argparse

import numpy as np

from nvg.artifacts import check_encoded_from, read_windows
from nvg.cmf import read_verified
from nvg.model import Llama, load_model, pick_device
from nvg.sources import ChatRenderer, source_tokens
from nvg.tokenizer import cmf_tokenizer


def parsed_arguments(description: str, ood: list[str], ood_tokens: int, batch: int, extra=None) -> argparse.Namespace:
    """The command line both scripts take: teacher, student, windows, the unseen texts, batch, device, precision, out;
    `extra(parser)` adds a script's own."""
    ap = argparse.ArgumentParser(description=description)
    if extra is not None:
        extra(ap)
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--student", required=True)
    ap.add_argument("--windows", required=True, help="windows.h5: its held-out rows are scored")
    ap.add_argument("--ood", nargs="*", default=ood)
    ap.add_argument("--ood-tokens", type=int, default=ood_tokens)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--out", required=True)
    return ap.parse_args()


def teacher_student_and_texts(a: argparse.Namespace) -> tuple[Llama, Llama, dict[str, np.ndarray], object]:
    """(teacher, student, {"held-out": windows, source: windows, ...}, device) for `parsed_arguments`' `a`."""
    teacher, student, windows, ood, ood_tokens, device = a.teacher, a.student, a.windows, a.ood, a.ood_tokens, a.device
    t_cmf, s_cmf = read_verified(teacher), read_verified(student)
    check_encoded_from(s_cmf, t_cmf)  # as evaluate does: a student of another teacher would be scored as nonsense
    tokens, attrs = read_windows(windows, t_cmf.arch["vocab_size"])
    sets = {"held-out": tokens[int(attrs["n_train"]):]}
    tok = cmf_tokenizer(t_cmf, teacher, "tokenize --ood with")
    window = tokens.shape[1]
    for source in ood:
        ids = source_tokens(source, ood_tokens, tok, ChatRenderer(t_cmf, source))
        sets[source] = ids[: len(ids) // window * window].reshape(-1, window)
    dev = pick_device(device)
    return load_model(t_cmf, dev), load_model(s_cmf, dev), sets, dev
