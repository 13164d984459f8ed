"""Encoder comparison for docs/encoder.md: nvg's data-aware method against LittleBit's Dual-SVID.

For each budget and method: encode every body linear (the budget_reencode step module), then score the
encoded student on the held-out windows (the evaluate step module's scorer) before any training.

    python bench/encoder_study.py TEACHER.cmf WINDOWS.h5 GRAMS.h5 WORKDIR OUT.json [--bpw 1.0 0.55 0.3]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from nvg.budget_reencode import main as encode
from nvg.encoder import EncodeSettings
from nvg.evaluate import EvalSettings, ScoredSet, student_pass, summary, teacher_pass
from nvg.model import load_model, pick_device
from nvg.artifacts import read_windows
from nvg.settings import load


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("teacher", type=Path)
    ap.add_argument("windows", type=Path)
    ap.add_argument("grams", type=Path)
    ap.add_argument("workdir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--bpw", type=float, nargs="+", default=[1.0, 0.55, 0.3])
    ap.add_argument("--methods", nargs="+", default=["dual-svid", "nvg"])
    a = ap.parse_args()
    device = pick_device("auto")
    tokens, attrs = read_windows(a.windows)
    heldout = tokens[int(attrs["n_train"]):]
    teacher = load_model(a.teacher, device)
    eval_settings = load(EvalSettings, batch=8)
    sets = [ScoredSet("held-out", heldout)]
    teacher_pass(teacher, sets, eval_settings, device, 64)
    results = {"device": str(device), "heldout_tokens": int(heldout.size), "runs": {}}
    for bpw in a.bpw:
        for method in a.methods:
            name = f"{method}-{bpw}"
            t0 = time.perf_counter()
            encode(a.teacher, a.grams, a.workdir / f"{name}.cmf", a.workdir / f"{name}.json",
                   load(EncodeSettings, bpw=bpw, method=method))
            seconds = time.perf_counter() - t0
            report = json.loads((a.workdir / f"{name}.json").read_text())
            student = load_model(a.workdir / f"{name}.cmf", device)
            student_pass("student", student, teacher.head_weight, sets, eval_settings, device)
            s = summary(sets[0], 64)
            results["runs"][name] = {
                "bpw": bpw, "method": method, "encode_seconds": seconds, "body_bpw": report["body_bpw"],
                "file_bpw": report["file_bpw"], "mean_rel_sel_error": report["mean_rel_sel_error"],
                "rel_sel_error": {n: r["rel_sel_error"] for n, r in report["tensors"].items()},
                "heldout": s["student"], "teacher_heldout": s["teacher"],
            }
            print(f"{name}: {seconds:.0f}s, mean rel SEL error {report['mean_rel_sel_error']:.4f}, "
                  f"held-out ppl {s['student']['perplexity']:.2f} (teacher {s['teacher']['perplexity']:.2f})", flush=True)
        if {"dual-svid", "nvg"} <= set(a.methods):
            d, n = results["runs"][f"dual-svid-{bpw}"], results["runs"][f"nvg-{bpw}"]
            ratio = [n["rel_sel_error"][t] / d["rel_sel_error"][t] for t in d["rel_sel_error"]]
            results[f"compare-{bpw}"] = {
                "nvg_lower_on_every_tensor": bool(max(ratio) < 1), "worst_ratio": float(max(ratio)),
                "mean_reduction": float(1 - np.mean([n["rel_sel_error"][t] for t in d["rel_sel_error"]]) /
                                        np.mean(list(d["rel_sel_error"].values()))),
                "mean_of_ratios": float(np.mean(ratio)),
            }
            print(json.dumps(results[f"compare-{bpw}"]), flush=True)
    a.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
