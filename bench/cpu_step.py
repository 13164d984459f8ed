"""The default job's distillation step on the CPU, timed (docs/benchmarks.md).

    python bench/cpu_step.py results/student/encoded.cmf results/data/windows.h5 --teacher results/teacher.cmf
    python bench/cpu_step.py results/student/encoded.cmf results/data/windows.h5 --topk results/teacher/topk.0.h5 \\
        --settings '{"targets": "topk"}'

The student, targets, Distiller and optimizer as train_student builds them (`nvg.train_student.setup`), from the
schema's train settings (README command 1's: the live teacher, the hidden-state loss at 0.3, one window a step, bf16:
autocast on a CPU with native bf16 matmuls, float32 on others) with `--settings` (a JSON object, as the rule passes
it) over them. Six steps on six training windows, then the same six again: with a live teacher the first round runs
it (the job's first epoch) and the second reads its states from the memo (every later epoch). Each round's median
step (`Distiller.step` at the peak rate, as train_student takes it), then one held-out KL pass. Its saved state goes
to a temporary folder, never the job's."""

import argparse
import json
import tempfile
import time
from pathlib import Path

from nvg.settings import load
from nvg.train_student import TrainSettings, setup

ap = argparse.ArgumentParser()
ap.add_argument("student", type=Path)
ap.add_argument("windows", type=Path)
ap.add_argument("--teacher", type=Path, help="the teacher CMF (train.targets: live, the default)")
ap.add_argument("--topk", type=Path, nargs="+", default=[], help="the cached top-k (train.targets: topk)")
ap.add_argument("--settings", default="{}", help="train settings over the schema's defaults (JSON)")
args = ap.parse_args()
with tempfile.TemporaryDirectory() as state_root:
    settings = load(TrainSettings, args.settings, device="cpu", state_root=state_root)
    run = setup(args.student, args.windows, args.topk, settings, teacher=args.teacher)
    d, opt = run.d, run.opt
    rows = [list(range(i * settings.batch, (i + 1) * settings.batch)) for i in range(6)]
    rounds = []
    for _ in range(2):
        seconds = []
        for batch in rows:
            t = time.perf_counter()
            d.step(batch, opt, 1.0, run.state.gscale, lr=settings.lr, clip=settings.clip)
            seconds.append(time.perf_counter() - t)
        rounds.append(sorted(seconds)[len(seconds) // 2])
    t = time.perf_counter()
    d.heldout_kl()
    heldout = time.perf_counter() - t
    run.lock.close()
print(json.dumps({"targets": settings.targets, "hidden_weight": settings.hidden_weight if settings.targets == "live" else None,
                  "batch": settings.batch, "tokens": settings.batch * d.targets.tokens.shape[1],
                  "step_s_first_round": rounds[0], "step_s_second_round": rounds[1], "heldout_kl_pass_s": heldout}))
