"""Students of different runs scored on the same texts: the teacher's own text that none of them trained on
(windows cut from a generate_corpus shard of another run, e.g. the GPU corpus carried in .corpus/), and any
source of `data.sources`' grammar. eval.json's held-out windows are each run's own draw, so two runs whose
calibration mixes differ (a real source mixed in) are held out on different windows; this scores them on one
set (issue #17, session 38).

    python bench/score_students.py --teacher results/teacher.cmf --corpus generated.1.h5 --windows 16 \
        --window 256 --student default=eval-a/model.cmf --student manuals=eval-b/model.cmf --out scores.json \
        [--source python-docs ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from nvg.artifacts import model_hash, read_corpus_shard
from nvg.cmf import read_verified
from nvg.evaluate import EvalSettings, ScoredSet, student_pass, summary, teacher_pass
from nvg.model import load_model, pick_device
from nvg.settings import load
from nvg.sources import ChatRenderer, source_tokens
from nvg.tokenizer import cmf_tokenizer


def corpus_windows(shard: Path, teacher_hash: str, n: int, window: int, seed: int) -> np.ndarray:
    """`n` windows of `window` tokens, each the start of a different sequence of the shard (checked as the
    pipeline checks one, whatever its place), drawn by `seed`."""
    seqs, _ = read_corpus_shard(shard, teacher_hash)
    rows = np.sort(np.random.default_rng(seed).choice(len(seqs), n, replace=False))
    return np.ascontiguousarray(seqs[rows, :window])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", required=True, type=Path)
    ap.add_argument("--student", action="append", required=True, help="NAME=PATH of a student CMF")
    ap.add_argument("--corpus", type=Path, help="a generate_corpus shard (its teacher must be --teacher)")
    ap.add_argument("--windows", type=int, default=16, help="windows from the corpus shard")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--source", action="append", default=[], help="a text source (nvg/sources.py), its first --tokens")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args()
    settings = load(EvalSettings, batch=4)
    device = pick_device(settings.device)
    teacher_cmf = read_verified(a.teacher)
    sets = []
    if a.corpus:
        sets.append(ScoredSet(f"generated:{a.corpus.name}",
                              corpus_windows(a.corpus, model_hash(teacher_cmf), a.windows, a.window, a.seed)))
    tok = cmf_tokenizer(teacher_cmf, a.teacher, "tokenize with")
    for source in a.source:
        ids = source_tokens(source, a.tokens, tok, ChatRenderer(teacher_cmf, source))
        sets.append(ScoredSet(source, ids[: len(ids) // a.window * a.window].reshape(-1, a.window)))
    teacher = load_model(teacher_cmf, device)
    teacher_pass(teacher, sets, settings, device, 64)
    t_head = teacher.head_weight
    del teacher
    for spec in a.student:
        name, path = spec.split("=", 1)
        student_pass(name, load_model(read_verified(Path(path)), device), t_head, sets, settings, device)
    report = {st.label: summary(st, 64) for st in sets}
    a.out.write_text(json.dumps(report, indent=1))
    for label, r in report.items():
        print(label, r["tokens"], "tokens:", ", ".join(
            f"{name} {r[name]['ppl_ratio']:.3f}×" for name in r if isinstance(r[name], dict) and "ppl_ratio" in r[name]))


if __name__ == "__main__":
    main()
