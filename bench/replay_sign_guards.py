"""Replay train_student's per-step sign guards on a recorded run: where would the flip-rate and spike
guards have fired, given that run's flips a step? Only the first firing is a prediction: from there on
a guarded run's η, and so its flips, differ from the recorded ones.

    python bench/replay_sign_guards.py docs/runs/metrics-s22-live_uv_bsigns_max.jsonl.gz \
        --signs 91699200 --steps 2550 --set max_step_flip=0.01 --first 3

`--set key=value` overrides a `train.signs` setting (the recipe's overlay); the rest are the schema's
defaults. `--signs` is the run's sign count (its log's "sign training: N signs" line).
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import yaml

from nvg.distill import lr_shape
from nvg.distributed import Group
from nvg.settings import load
from nvg.sign_training import SignSettings, SignTrainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("metrics", type=Path, help="train_student's metrics.jsonl (or .jsonl.gz)")
    ap.add_argument("--signs", type=int, required=True, help="signs trained in the run")
    ap.add_argument("--steps", type=int, required=True, help="the run's total steps (its schedule)")
    ap.add_argument("--set", action="append", default=[], help="key=value of train.signs")
    ap.add_argument("--first", type=int, default=5, help="stop after this many guard lines")
    a = ap.parse_args()
    overrides = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in a.set)}
    trainer = SignTrainer({}, load(SignSettings, enabled=True, **overrides), a.steps, Group())
    trainer.live = a.signs  # no matrices: only the guards' bookkeeping runs
    opener = gzip.open if a.metrics.suffix == ".gz" else open
    shown = 0
    with opener(a.metrics, "rt") as f:
        for record in map(json.loads, f):
            if "sign_flips" not in record:
                continue
            trainer.begin_step(lr_shape(record["step"], a.steps), 1.0)
            trainer.counters["sign_steps"] += 1
            flips = record["sign_flips"]
            for line in trainer.step_guards({"flips": flips, "flip_rate": flips / a.signs, "eta": trainer.eta}):
                print(f"step {record['step']} (loss {record['loss']:.3f}): {line}")
                shown += 1
            if shown >= a.first:
                break
    if not shown:
        print("no guard would have fired")


if __name__ == "__main__":
    main()
