"""One Adam update over a SmolLM2 student's trainable tensors, each in its own group (`train.lr_relative`): torch's
Adam (foreach, fused) against `nvg.adam.OnePassAdam`, the median of timed windows (host time on the CPU; on CUDA
with the update synchronised, so launches and kernels both count).

    python bench/adam_groups.py [--device cuda] [--embedding]

The tensors: h [2, d_out], ℓ [2, r], g [2, d_in] of the 210 BLR linears (P = 2, rank 64), every RMSNorm gain;
`--embedding` adds the f16 embedding's 49152 × 576 (`train.embedding_lr`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nvg.adam import OnePassAdam

HIDDEN, FFN, KV, LAYERS, RANK, VOCAB = 576, 1536, 192, 30, 64, 49152


def tensors(device, embedding: bool) -> list[torch.Tensor]:
    shapes = []
    for _ in range(LAYERS):
        for d_out, d_in in [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (FFN, HIDDEN), (FFN, HIDDEN),
                            (HIDDEN, FFN)]:
            shapes += [(2, d_out), (2, RANK), (2, d_in)]
        shapes += [(HIDDEN,), (HIDDEN,)]
    shapes += [(HIDDEN,)] + ([(VOCAB, HIDDEN)] if embedding else [])
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


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

    def groups():
        return [{"params": [p], "lr": 1e-3 * (1 + i % 7)} for i, p in enumerate(tensors(device, a.embedding))]

    optimizers = {"torch Adam, foreach": lambda: torch.optim.Adam(groups(), lr=1e-3, foreach=True),
                  "torch Adam, fused": lambda: torch.optim.Adam(groups(), lr=1e-3, fused=True),
                  "nvg OnePassAdam": lambda: OnePassAdam(groups(), lr=1e-3)}
    print(f"{len(groups())} tensors, one group each, on {device}")
    for name, make in optimizers.items():
        print(f"  {name}: {timed(make(), device):.2f} ms an update")


if __name__ == "__main__":
    main()
