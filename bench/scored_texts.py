"""What the student-scoring bench scripts (excess_by_entropy.py, layer_swap.py) share: a teacher and its student
from their CMF files, checked to belong together, and the texts to score them on: the held-out rows of windows.h5
and each out-of-domain source cut into windows of the same length."""

from __future__ import annotations

import numpy as np

from nvg.artifacts import check_encoded_from, read_windows
from nvg.cmf import read_verified
from nvg.model import Llama, load_model, pick_device
from nvg.sources import ChatRenderer, source_tokens
from nvg.tokenizer import cmf_tokenizer


def teacher_student_and_texts(teacher: str, student: str, windows: str, ood: list[str], ood_tokens: int,
                              device: str) -> tuple[Llama, Llama, dict[str, np.ndarray], object]:
    """(teacher, student, {"held-out": windows, source: windows, ...}, device)."""
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
