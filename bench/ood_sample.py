"""How much of an unseen text a perplexity ratio needs: a student against its teacher on windows of each
`evaluate.ood` text, taken from its start (as evaluate takes `ood_tokens`) and drawn from across all of it
(seeded), each window's log-likelihood kept, so that the ratio of any subset follows without running the
models again: the first 8, 64 windows; the 8-window blocks among them (their spread is what one short sample
can say); a draw of 64 from across the text (session 45, issue #17).

    python bench/ood_sample.py --teacher results/teacher.cmf --student results/model.cmf --out ood_sample.json \
        [--source python-docs --source pkg:shksprdata/ancillary/britannica-11th.txt] [--window 256 --windows 64]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

from nvg.cmf import read_verified
from nvg.losses import next_token_nll
from nvg.model import autocast, load_model, pick_device
from nvg.sources import ChatRenderer, source_tokens
from nvg.tokenizer import cmf_tokenizer

DEFAULT_SOURCES = ["python-docs", "pkg:shksprdata/ancillary/britannica-11th.txt"]


@torch.no_grad()
def window_nll(model, windows: np.ndarray, device, batch: int) -> np.ndarray:
    """Σ −log p(next token) of each window (float64 [n])."""
    out = []
    for s in range(0, len(windows), batch):
        ids = torch.from_numpy(windows[s : s + batch]).to(device)
        with autocast(device, "bf16"):
            h = model.hidden(ids)
            out += [float(next_token_nll(h[i, :-1], model.head_weight, ids[i, 1:])) for i in range(len(ids))]
    return np.asarray(out)


def ratio(t: np.ndarray, s: np.ndarray, per_window: int) -> float:
    """Perplexity ratio student / teacher over the windows given (each predicts `per_window` tokens)."""
    n = len(t) * per_window
    return math.exp(s.sum() / n) / math.exp(t.sum() / n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", required=True, type=Path)
    ap.add_argument("--student", required=True, type=Path)
    ap.add_argument("--source", action="append", help="an unseen text (data.sources' grammar); default: evaluate's two")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--windows", type=int, default=64, help="windows from the start, and as many drawn from across")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args()
    device = pick_device("auto")
    t_cmf = read_verified(a.teacher)
    tok = cmf_tokenizer(t_cmf, a.teacher, "tokenize with")
    models = {"teacher": load_model(t_cmf, device), "student": load_model(read_verified(a.student), device)}
    report = {}
    for source in a.source or DEFAULT_SOURCES:
        ids = source_tokens(source, 1 << 30, tok, ChatRenderer(t_cmf, source))
        whole = ids[: len(ids) // a.window * a.window].reshape(-1, a.window)
        first = np.arange(min(a.windows, len(whole)))
        spread = np.sort(np.random.default_rng(a.seed).choice(len(whole), min(a.windows, len(whole)), replace=False))
        rows = np.union1d(first, spread)
        nll = {name: dict(zip(rows.tolist(), window_nll(m, whole[rows], device, a.batch))) for name, m in models.items()}

        def of(sel):
            sel = list(sel)
            return ratio(np.array([nll["teacher"][r] for r in sel]), np.array([nll["student"][r] for r in sel]), a.window - 1)

        blocks = [of(first[i : i + 8]) for i in range(0, len(first) - 7, 8)]
        drawn_blocks = [of(spread[i : i + 8]) for i in range(0, len(spread) - 7, 8)]
        report[source] = {
            "windows_in_text": len(whole), "first_8": of(first[:8]), f"first_{len(first)}": of(first),
            "first_blocks_of_8": blocks, f"drawn_{len(spread)}": of(spread), "drawn_blocks_of_8": drawn_blocks,
            "teacher_ppl_first": math.exp(sum(nll["teacher"][r] for r in first) / (len(first) * (a.window - 1))),
            "teacher_ppl_drawn": math.exp(sum(nll["teacher"][r] for r in spread) / (len(spread) * (a.window - 1))),
        }
        print(source, json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in report[source].items()
                                  if not k.endswith("blocks_of_8")}),
              "blocks of 8 from the start:", [round(b, 2) for b in blocks], "drawn:", [round(b, 2) for b in drawn_blocks])
    a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
