"""The BLR codec and the BLR linear: layout, validation, bits per weight, dequantisation parity."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvg import blr as codec
from nvg.errors import NvgError
from nvg.model import BlrLinear
from tests.test_cmf import random_blr


@pytest.mark.parametrize("paths", [1, 2])
def test_encode_decode_round_trip(paths):
    b = random_blr(paths=paths)
    raw = b.encode()
    assert len(raw) == codec.payload_nbytes(paths, 16, 24, 32) == 16 + paths * (2 * (24 + 32 + 16) + 24 * 2 + 16 * 4)
    back = codec.decode(raw)
    assert back.encode() == raw
    np.testing.assert_array_equal(back.dequantize(), b.dequantize())


def test_layout_is_lsb_first_with_one_meaning_plus_one():
    su = -np.ones((8, 8))
    su[0, 0] = su[0, 3] = 1.0  # row 0 bits 0 and 3 → byte 0b1001
    sv = -np.ones((8, 8))
    sv[2, 7] = 1.0  # row 2 of the stored [r, d_in] V, column 7 → byte 0x80
    b = codec.BlrTensor.from_factors([(np.ones(8), np.ones(8), np.ones(8), su, sv)])
    raw = b.encode()
    assert raw[:4] == bytes([0x4C, 1, 1, 0]) and raw[4:16] == np.array([8, 8, 8], "<u4").tobytes()
    u_at = 16 + 2 * (8 + 8 + 8)
    assert raw[u_at] == 0b1001 and raw[u_at + 1 : u_at + 8] == bytes(7)
    assert raw[u_at + 8 + 2] == 0x80


def test_dequantize_matches_the_formula():
    b = random_blr(paths=2)
    w = np.zeros((24, 32))
    for p in b.paths:
        su, sv = p.signs()
        h, g, ell = (np.float16(x).astype(np.float64) for x in (p.h, p.g, p.ell))
        w += np.diag(h) @ su @ np.diag(ell) @ sv @ np.diag(g)
    np.testing.assert_allclose(b.dequantize(), w, rtol=1e-5, atol=1e-5)


def test_bits_per_weight_counts_every_byte_and_rank_fits_budget():
    assert codec.bits_per_weight(1, 16, 24, 32) == 8 * codec.payload_nbytes(1, 16, 24, 32) / (24 * 32)
    for bpw in (0.1, 0.3, 0.55, 1.0, 2.0):
        r = codec.max_rank(bpw, 2, 576, 1536)
        assert r % 8 == 0
        if r:
            assert codec.bits_per_weight(2, r, 576, 1536) <= bpw < codec.bits_per_weight(2, r + 8, 576, 1536)
    assert codec.max_rank(0.01, 1, 576, 576) == 0


@pytest.mark.parametrize("raw, message", [
    (b"\x4c\x01", "shorter than its 16-byte header"),
    (bytes([0x4D, 1, 1, 0]) + bytes(12), "blr magic 0x4d"),
    (bytes([0x4C, 2, 1, 0]) + bytes(12), "blr version 2"),
    (bytes([0x4C, 1, 3, 0]) + bytes(12), "blr paths 3"),
    (bytes([0x4C, 1, 1, 0]) + np.array([12, 8, 8], "<u4").tobytes(), "multiples of 8"),
    (bytes([0x4C, 1, 1, 0]) + np.array([8, 8, 8], "<u4").tobytes() + bytes(3), "needs"),
])
def test_bad_payloads_are_rejected(raw, message):
    with pytest.raises(NvgError, match=message):
        codec.decode(raw)


@pytest.mark.parametrize("paths", [1, 2])
def test_blr_linear_equals_its_dense_dequantisation(paths):
    b = codec.decode(random_blr(paths=paths, d_out=40, d_in=48, r=24).encode())  # f16-exact scales, as loaded
    lin = BlrLinear(b)
    x = torch.randn(3, 5, 48)
    dense = torch.from_numpy(b.dequantize())
    torch.testing.assert_close(lin(x), x @ dense.T, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lin.dense_weight(), dense, rtol=1e-4, atol=1e-4)
    assert lin.to_payload().encode() == b.encode()
