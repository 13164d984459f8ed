"""Encoder hot spots on random SmolLM2-shaped tensors (no teacher needed): torch.profiler over
`encode_tensor`, and the U-sign sweep three ways: the Triton kernel, numpy on the CPU, and the same
sweep as device tensor ops (the encoder's earlier form).

    python bench/encode_profile_synthetic.py OUT.txt
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from nvg import encoder as enc
from nvg import sign_sweep
from nvg.settings import load


def gpu_sweep(su, h, G, c):
    """The sweep as device tensor ops (the encoder's previous form), for comparison."""
    su = su.clone()
    gs = su @ G
    for k in range(su.shape[1]):
        sk = su[:, k]
        delta = h * h * (-4 * sk * gs[:, k] + 4 * G[k, k]) + 4 * h * sk * c[:, k]
        flip = delta < 0
        gs -= (2 * sk * flip)[:, None] * G[k][None, :]
        su[:, k] = torch.where(flip, -sk, sk)
    return su


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the report (text), also printed")
    out = open(ap.parse_args().out, "w")
    say = lambda *a: (print(*a), print(*a, file=out))  # noqa: E731
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rng = np.random.default_rng(0)
    shapes = {"q": (576, 576), "k": (192, 576), "gate": (1536, 576), "down": (576, 1536)}
    data = {}
    for role, (o, i) in shapes.items():
        X = rng.standard_normal((4096, i)).astype(np.float32) * rng.uniform(0.1, 3, i).astype(np.float32)
        data[role] = (rng.standard_normal((o, i)).astype(np.float32) * 0.05, (X.T @ X).astype(np.float32))
    s = load(enc.EncodeSettings, bpw=1.0)
    for role, (W, H) in data.items():  # warm-up (cuBLAS/cuSOLVER handles)
        enc.encode_tensor(W, H, H, 1.0, role, 64, s, dev, role)
    sync()
    t = time.perf_counter()
    for role, (W, H) in data.items():
        enc.encode_tensor(W, H, H, 1.0, role, 64, s, dev, role)
    sync()
    say(f"device {dev}: 4 tensors (q, k, gate, down) at 1.0 bpw in {time.perf_counter() - t:.3f} s")
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])) as prof:
        for role, (W, H) in data.items():
            enc.encode_tensor(W, H, H, 1.0, role, 64, s, dev, role)
        sync()
    say(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    o, r = 1536, 256
    su = torch.sign(torch.randn(o, r, device=dev))
    h, M = torch.rand(o, device=dev), torch.randn(r, 576, device=dev)
    G, c = M @ M.T, torch.randn(o, r, device=dev) * 10
    ways = [("numpy float64 sweep on the CPU", sign_sweep._sweep_cpu), ("device tensor-op sweep", gpu_sweep)]
    if dev.type == "cuda" and sign_sweep.triton is not None:
        ways.insert(0, ("Triton kernel", sign_sweep._sweep_cuda))
    for name, fn in ways:
        fn(su, h, G, c)
        sync()
        t = time.perf_counter()
        for _ in range(3):
            fn(su, h, G, c)
        sync()
        say(f"{name}: {(time.perf_counter() - t) / 3 * 1e3:.1f} ms per sweep of [{o}, {r}]")


if __name__ == "__main__":
    main()
