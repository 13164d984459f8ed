"""One distillation step of the default job's student on the CPU, timed by part (docs/benchmarks.md).

    python bench/cpu_step.py results/student/encoded.cmf results/data/windows.h5 results/teacher/topk.0.h5 --batch 1 [--precision fp32]

Six steps on the same windows (top-k targets; `--precision bf16`, the default job's setting, is bf16 autocast on
a CPU with native bf16 matmuls and float32 on others); the median of forward, backward and the Adam update, then
one held-out KL pass."""

import argparse
import time
from pathlib import Path

import torch

from nvg.distill import Distiller, Targets, param_groups
from nvg.model import load_model

ap = argparse.ArgumentParser()
ap.add_argument("student", type=Path)
ap.add_argument("windows", type=Path)
ap.add_argument("topk", type=Path, nargs="+")
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"], help="the stage setting (bf16: the default job's)")
args = ap.parse_args()
student = load_model(args.student, "cpu")
targets = Targets.from_files(args.windows, args.topk, student.cfg.vocab_size)
d = Distiller(student, targets, torch.device("cpu"), batch=args.batch, precision=args.precision)
opt = torch.optim.Adam(param_groups(d.params, True), lr=0.01)
rows = list(range(args.batch))
times = {"forward": [], "backward": [], "adam": []}
for _ in range(6):
    t0 = time.perf_counter()
    loss = d.loss(rows)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    for part, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
        times[part].append(seconds)
t = time.perf_counter()
d.heldout_kl()
print(f"batch {args.batch} ({args.batch * targets.tokens.shape[1]} tokens): "
      + ", ".join(f"{part} {sorted(v)[len(v) // 2]:.3f} s" for part, v in times.items())
      + f"; held-out KL pass {time.perf_counter() - t:.2f} s")
