"""One Adam update over a SmolLM2 student's trainable tensors, a group each as `train.lr_relative` makes them
(`distill.param_groups`): torch's Adam (foreach, fused) against `nvg.adam.OnePassAdam`, the median of timed windows
(host time on the CPU; on CUDA with the update synchronised, so launches and kernels both count).

    python bench/adam_groups.py [--device cuda] [--embedding]

The student is gpu_bench's: SmolLM2-135M's shape, random weights, every body linear BLR at 1 bpw (P = 2); its
trainable tensors are train_student's (`distill.trainable`): h, ℓ, g and the norm gains, and with `--embedding` the
f16 embedding too (`train.embedding_lr`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import SMOLLM2_135M, blr_student, hf_model  # noqa: E402  (the step benchmark's student)

from nvg.adam import OnePassAdam  # noqa: E402
from nvg.distill import param_groups, trainable  # noqa: E402


def timed(opt, device, windows: int = 5, updates: int = 20) -> float:
    """Median ms an update over `windows` windows of `updates`, after three untimed."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        opt.step()
    times = []
    for _ in range(windows):
        sync()
        t0 = time.perf_counter()
        for _ in range(updates):
            opt.step()
        sync()
        times.append((time.perf_counter() - t0) / updates * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--embedding", action="store_true")
    a = ap.parse_args()
    device = torch.device(a.device)
    torch.manual_seed(0)
    dense = {n: p.detach().float() for n, p in hf_model(SMOLLM2_135M, None, "cpu").state_dict().items() if n != "lm_head.weight"}
    params = trainable(blr_student(SMOLLM2_135M, dense, 1.0).to(device), train_dense_vocab=a.embedding)
    for p in params.values():
        p.grad = torch.randn_like(p)
    def groups():  # afresh for each optimizer: torch's writes its settings into the group dicts it is given
        return param_groups(params, relative=True)

    optimizers = {"torch Adam, foreach": lambda: torch.optim.Adam(groups(), lr=1e-3, foreach=True),
                  "torch Adam, fused": lambda: torch.optim.Adam(groups(), lr=1e-3, fused=True),
                  "nvg OnePassAdam": lambda: OnePassAdam(groups(), lr=1e-3)}
    print(f"{len(params)} tensors, one group each, on {device}")
    for name, make in optimizers.items():
        print(f"  {name}: {timed(make(), device):.2f} ms an update")


if __name__ == "__main__":
    main()
