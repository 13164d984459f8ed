"""Where the encoder's time goes (issue #4): per phase of `encode_tensor`, with a device sync around each.

    python bench/encode_profile.py TEACHER.cmf GRAMS.h5 OUT.json [--layers 2] [--bpw 1.0]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from nvg import encoder as enc
from nvg.cmf import read_cmf, tensor_to_numpy
from nvg.artifacts import read_grams
from nvg.layout import ROLE_INPUT, parse_body_linear
from nvg.model import pick_device
from nvg.settings import load


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("teacher", type=Path)
    ap.add_argument("grams", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--bpw", type=float, default=1.0)
    a = ap.parse_args()
    device = pick_device("auto")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    seconds = defaultdict(float)

    def timed(name, fn):
        def run(*args, **kw):
            sync()
            t = time.perf_counter()
            out = fn(*args, **kw)
            sync()
            seconds[name] += time.perf_counter() - t
            return out
        return run

    enc.top_singular = timed("top_singular (float64 eigh)", enc.top_singular)
    enc.refine_path = timed("refine_path (h, ℓ, g fits + U-sign sweeps)", enc.refine_path)
    enc.damped = timed("damped (Cholesky)", enc.damped)
    enc.rel_error = timed("rel_error", enc.rel_error)
    cmf = read_cmf(a.teacher)
    names = [n for n in cmf.tensors if parse_body_linear(n) and parse_body_linear(n)[0] < a.layers]
    t0 = time.perf_counter()
    for name in names:
        layer, role = parse_body_linear(name)
        H_fit, H_sel, _, _ = read_grams(a.grams, layer, ROLE_INPUT[role])
        enc.encode_tensor(tensor_to_numpy(cmf.tensors[name]), H_fit, H_sel, a.bpw, role, cmf.arch["head_dim"],
                          load(enc.EncodeSettings, bpw=a.bpw), device, name)
    sync()
    total = time.perf_counter() - t0
    report = {"device": str(device), "tensors": len(names), "bpw": a.bpw, "total_s": total,
              "per_tensor_s": total / len(names), "phases_s": dict(seconds)}
    a.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
