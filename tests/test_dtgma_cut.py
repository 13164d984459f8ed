"""DTG-MA: exact cuts (BLR equals the dense cut of its dequantisation), widths, dead neurons, config."""

from __future__ import annotations

import numpy as np
import pytest

from nvg import blr as codec
from nvg.cmf import BLR, F16, Tensor, dense_tensor, tensor_to_numpy
from nvg.dtgma_cut import DtgmaSettings, choose_widths, cut_tensor
from nvg.errors import NvgError
from nvg.settings import load
from tests.test_cmf import random_blr


@pytest.mark.parametrize("rows", [True, False])
def test_blr_cut_equals_the_dense_cut_exactly(rows):
    b = codec.decode(random_blr(paths=2, d_out=48, d_in=64, r=16).encode())
    t = Tensor("w", BLR, (48, 64), b.encode())
    keep = np.arange(0, 48 if rows else 64, 3)[:16]
    cut = cut_tensor(t, keep, rows)
    dense = dequantize64(b)
    want = dense[keep] if rows else dense[:, keep]
    assert cut.shape == want.shape
    # every term is a product of f16 values, exact in float64: equal up to summation order only
    np.testing.assert_allclose(dequantize64(codec.decode(bytes(cut.data))), want, rtol=1e-13, atol=1e-13)


def dequantize64(b):
    w = 0
    for p in b.paths:
        su, sv = p.signs()
        w = w + (p.h[:, None].astype(np.float64) * su * p.ell[None, :]) @ (sv * p.g[None, :].astype(np.float64))
    return w


def test_dense_cut():
    w = np.arange(32, dtype=np.float32).reshape(4, 8)
    cut = cut_tensor(dense_tensor("w", w, F16), np.array([1, 3]), rows=False)
    np.testing.assert_array_equal(tensor_to_numpy(cut), w[:, [1, 3]])


def test_widths_respect_floor_align_and_rank():
    rng = np.random.default_rng(0)
    logits = [rng.normal(size=512) for _ in range(3)]
    logits[2] -= 10  # a layer the gates want gone still keeps its 25 % floor
    kept = choose_widths(logits, keep=0.5, align=128, floor=0.25)
    widths = [len(k) for k in kept]
    assert all(w % 128 == 0 for w in widths) and widths[2] == 128
    assert abs(sum(widths) - 768) <= 128 * 3
    for lg, k in zip(logits, kept):  # the kept neurons are the best-ranked of their layer
        assert lg[k].min() >= np.sort(lg)[::-1][len(k) - 1]


def test_planted_dead_neurons_are_cut():
    logits = [np.concatenate([np.full(64, 3.0), np.full(64, -3.0)]) for _ in range(2)]
    kept = choose_widths(logits, keep=0.5, align=8, floor=0.25)
    for k in kept:
        assert list(k) == list(range(64))


@pytest.mark.parametrize("keep", [0, 1, 1.5, -0.2])
def test_keep_outside_the_open_interval_is_a_config_error(keep):
    with pytest.raises(NvgError, match="config dtgma.keep: "):
        load(DtgmaSettings, {"keep": keep})
