"""Where a student's extra perplexity lies: by how sure the teacher is of the next token, and at copies.

The ratio evaluate reports is exp(mean over positions of the student's NLL minus the teacher's). This splits
that mean by the teacher's entropy at each position, on the held-out windows and on each out-of-domain text:
per bin, the share of positions and the mean excess NLL. Then it asks whether the out-of-domain ratio is what
the held-out windows' excess per bin predicts for the out-of-domain text's own mix of bins ("mix-predicted"):
if so, the unseen text is harder only because the teacher is surer there, and training text on which the
teacher is surer is what would help; if the actual ratio is higher, the student fails on the unseen text's
contexts as such, at equal teacher certainty.

It also splits each text's positions into copies and the rest: a copy is a position whose token pair (this token,
the next) already occurred earlier in the window, so that an induction head can predict it by looking back (a
name used before, the rest of a repeated phrase). If the student's extra loss on the unseen texts sits in their
copies, the teacher's samples exercise copying too little, and text with more repetition is what would help.

    python bench/excess_by_entropy.py --teacher results/teacher.cmf --student results/model.cmf \\
        --windows results/data/windows.h5 --ood python-docs pkg:shksprdata/ancillary/britannica-11th.txt \\
        --ood-tokens 16384 --out excess.json
"""

from __future__ import annotations

import json
import math

import numpy as np
import torch

from nvg.model import autocast
from scored_texts import parsed_arguments, teacher_student_and_texts

EDGES = [0.0, 0.25, 0.5, 1.0, 2.0, 3.0, 4.0, float("inf")]  # teacher entropy, nats


@torch.no_grad()
def per_position(teacher, student, windows: np.ndarray, device, precision: str, batch: int) -> dict:
    """Teacher entropy, teacher NLL and student NLL of every predicted position, float64 numpy [n]."""
    out = {"entropy": [], "t_nll": [], "s_nll": []}
    for s in range(0, len(windows), batch):
        ids = torch.from_numpy(windows[s : s + batch]).to(device)
        targets = ids[:, 1:].reshape(-1)
        with autocast(device, precision):
            t_h, s_h = teacher.hidden(ids)[:, :-1], student.hidden(ids)[:, :-1]
        t_logp = (t_h.reshape(-1, t_h.shape[-1]).float() @ teacher.head_weight.float().T).log_softmax(-1)
        s_logp = (s_h.reshape(-1, s_h.shape[-1]).float() @ student.head_weight.float().T).log_softmax(-1)
        out["entropy"].append(-(t_logp.exp() * t_logp).sum(-1))
        out["t_nll"].append(-t_logp.gather(-1, targets[:, None])[:, 0])
        out["s_nll"].append(-s_logp.gather(-1, targets[:, None])[:, 0])
    return {k: torch.cat(v).double().cpu().numpy() for k, v in out.items()}


def copy_positions(windows: np.ndarray) -> np.ndarray:
    """Per predicted position (window by window, as `per_position` orders them): whether the pair (token t,
    token t+1) occurred at some earlier j < t of the same window. Bool [n]."""
    out = []
    for w in windows.astype(np.int64):
        pair = w[:-1] * (int(w.max()) + 1) + w[1:]  # one integer a token pair
        earlier = (pair[None, :] == pair[:, None]) & np.tri(len(pair), k=-1, dtype=bool)  # [t, j]: j < t, same pair
        out.append(earlier.any(1))
    return np.concatenate(out)


def excess_stats(p: dict, m: np.ndarray) -> dict:
    """The positions `m` selects: their share, count, mean excess NLL and mean teacher NLL."""
    excess = p["s_nll"] - p["t_nll"]
    return {"share": float(m.mean()), "positions": int(m.sum()),
            "mean_excess_nll": float(excess[m].mean()) if m.any() else None,
            "teacher_nll": float(p["t_nll"][m].mean()) if m.any() else None}


def by_copy(p: dict, copies: np.ndarray) -> dict:
    return {"copy": excess_stats(p, copies), "other": excess_stats(p, ~copies)}


def by_bin(p: dict) -> list[dict]:
    return [{"entropy": [lo, hi], **excess_stats(p, (p["entropy"] >= lo) & (p["entropy"] < hi))}
            for lo, hi in zip(EDGES[:-1], EDGES[1:])]


def main():
    a = parsed_arguments(__doc__.splitlines()[0], ood=["python-docs", "pkg:shksprdata/ancillary/britannica-11th.txt"], ood_tokens=2048, batch=4)
    teacher, student, sets, device = teacher_student_and_texts(a)
    report = {}
    reference = None
    for label, w in sets.items():
        p = per_position(teacher, student, w, device, a.precision, a.batch)
        bins, copies = by_bin(p), by_copy(p, copy_positions(w))
        actual = float((p["s_nll"] - p["t_nll"]).mean())
        entry = {"ppl_ratio": math.exp(actual), "teacher_mean_entropy": float(p["entropy"].mean()), "bins": bins,
                 "copies": copies}
        if reference is None:
            reference = bins, copies
        else:  # the held-out windows' excess per bin (per copy class), at this text's mix of bins (classes)
            pred = sum(b["share"] * r["mean_excess_nll"] for b, r in zip(bins, reference[0])
                       if b["share"] > 0 and r["mean_excess_nll"] is not None)
            entry["mix_predicted_ppl_ratio"] = math.exp(pred)
            pred = sum(c["share"] * reference[1][k]["mean_excess_nll"] for k, c in copies.items()
                       if c["share"] > 0 and reference[1][k]["mean_excess_nll"] is not None)
            entry["copy_mix_predicted_ppl_ratio"] = math.exp(pred)
        report[label] = entry
        print(f"{label}: ratio {entry['ppl_ratio']:.3f}" + (f", mix-predicted {entry['mix_predicted_ppl_ratio']:.3f}"
              if "mix_predicted_ppl_ratio" in entry else "") + f", teacher entropy {entry['teacher_mean_entropy']:.3f}")
        for b in bins:
            if b["positions"]:
                print(f"  H in [{b['entropy'][0]}, {b['entropy'][1]}): {b['share']:6.1%} of positions, "
                      f"excess NLL {b['mean_excess_nll']:.3f}, teacher NLL {b['teacher_nll']:.3f}")
        for k, c in copies.items():
            if c["positions"]:
                print(f"  {k:5}: {c['share']:6.1%} of positions, excess NLL {c['mean_excess_nll']:.3f}, "
                      f"teacher NLL {c['teacher_nll']:.3f}")
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
