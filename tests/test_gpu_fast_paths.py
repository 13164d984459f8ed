"""The CUDA fast paths against their reference implementations, run on the GPU machine
(`python -m pytest tests/test_gpu_fast_paths.py` there). Without a GPU there is nothing to compare:
the reference paths are what the CPU runs, and the other test files cover them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvg import budget_reencode as enc
from nvg import sign_sweep

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="compares CUDA fast paths; needs a GPU")


@pytest.mark.parametrize("o, r", [(1536, 280), (576, 136), (192, 64), (100, 8)])
def test_triton_sign_sweep_equals_the_cpu_sweep(o, r):
    g = torch.Generator().manual_seed(o + r)
    su = torch.sign(torch.randn(o, r, generator=g))
    h, M = torch.rand(o, generator=g), torch.randn(r, 576, generator=g)
    G, c = M @ M.T, torch.randn(o, r, generator=g) * 10
    ref = sign_sweep._sweep_cpu(su, h, G, c)
    fast = sign_sweep.flip_u_signs(*(x.cuda() for x in (su, h, G, c)))
    assert fast.is_cuda and (ref != su).any()
    assert torch.equal(fast.cpu(), ref)


def test_encoding_on_cuda_matches_the_cpu():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((2048, 576)).astype(np.float32) * rng.uniform(0.1, 3, 576).astype(np.float32)
    W, H = rng.standard_normal((1536, 576)).astype(np.float32) * 0.05, (X.T @ X).astype(np.float32)
    s = enc.EncodeSettings(bpw=1.0)
    _, cpu = enc.encode_tensor(W, H, H, 1.0, "gate", 64, s, torch.device("cpu"), "gate")
    _, gpu = enc.encode_tensor(W, H, H, 1.0, "gate", 64, s, torch.device("cuda"), "gate")
    assert (gpu["paths"], gpu["rank"]) == (cpu["paths"], cpu["rank"])
    assert gpu["rel_sel_error"] == pytest.approx(cpu["rel_sel_error"], rel=0.02)
