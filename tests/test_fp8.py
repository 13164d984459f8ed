"""nvg/fp8.py: a BLR linear's GEMMs in fp8, against the dense form's autograd. `_scaled_mm` runs on the CPU
too, so these run the very function the GPU runs; tests/test_gpu_fast_paths.py compares the two devices and
trains with it."""

from __future__ import annotations

import pytest
import torch

from nvg import fp8
from nvg.errors import NvgError


def blr_factors(paths=2, d_out=96, d_in=64, rank=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    sign = lambda *shape: torch.randint(0, 2, shape, generator=g).float() * 2 - 1  # noqa: E731
    return [torch.randn(paths, d_out, generator=g), torch.rand(paths, rank, generator=g) + 0.1,
            torch.randn(paths, d_in, generator=g), sign(paths, d_out, rank), sign(paths, rank, d_in)]


def dense(x, h, ell, g, su, sv):
    return x @ torch.einsum("po,por,pr,pri,pi->oi", h, su, ell, sv, g).t()


def relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("signs_train", [False, True])
def test_every_gradient_is_the_dense_forms_to_the_rounding_of_fp8(signs_train):
    """Output and the gradients of x, h, ℓ, g (and of the signs when sign training asks) within e4m3's rounding
    (3 mantissa bits: a few per cent) of the float32 dense form, two paths, a rank (20) that is padded to 32,
    three leading dimensions; the output in bf16 and each gradient in its input's dtype."""
    factors = blr_factors()
    for t in factors[:3] + (factors[3:] if signs_train else []):
        t.requires_grad_(True)
    x = torch.randn(3, 17, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    inputs = [x, *factors]
    asks = [t for t in inputs if t.requires_grad]
    y_ref = dense(*inputs)
    dy = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(2))
    grads_ref = torch.autograd.grad(y_ref, asks, dy)
    y = fp8.blr_matmul(*inputs)
    grads = torch.autograd.grad(y, asks, dy)
    assert y.dtype == torch.bfloat16 and y.shape == y_ref.shape
    assert 0 < relative_error(y, y_ref) < 0.05
    assert len(grads) == (6 if signs_train else 4)
    for got, want, t in zip(grads, grads_ref, asks):
        assert got.shape == t.shape and got.dtype == t.dtype
        assert 0 < relative_error(got, want) < 0.06


def test_each_token_is_rounded_on_its_own_scale():
    """A token whose activations are 10⁵ times the others' (past e4m3's normal range, 2⁻⁶ to 448) costs the
    others no precision: every row of the output keeps e4m3's few per cent, where one scale for the whole
    tensor leaves each other row 15 % or more off from rounding its input alone."""
    factors = blr_factors(paths=1, rank=16)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    x[0] *= 1e5
    y_ref = dense(x, *factors)
    row_error = lambda y: (y.float() - y_ref).norm(dim=1) / y_ref.norm(dim=1)  # noqa: E731
    assert row_error(fp8.blr_matmul(x, *factors)).max() < 0.08
    tensor_scale = x.abs().max() / fp8.E4M3_MAX
    one_scale = (x / tensor_scale).to(fp8.E4M3).float() * tensor_scale
    assert row_error(dense(one_scale, *factors))[1:].min() > 0.15
    codes, scale = fp8.quantize_rows(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (8, 1)
    assert torch.equal(codes.float().abs().amax(1), torch.full((8,), fp8.E4M3_MAX))
    zero_codes, zero_scale = fp8.quantize_rows(torch.zeros(2, 16))
    assert torch.equal(zero_scale, torch.ones(2, 1)) and not zero_codes.float().any()


def test_fp8_training_is_refused_where_there_are_no_fp8_tensor_cores(stage_inputs):
    """`train.fp8` on a device without fp8 GEMMs (this CPU) stops before any step with one line naming the key."""
    from tests.conftest import train

    assert not fp8.has_fp8_matmuls(torch.device("cpu"))
    with pytest.raises(NvgError, match=r"config train.fp8: needs a CUDA GPU with fp8 tensor cores \(compute capability 8.9 "
                                       r"or newer\); this run is on cpu"):
        train(stage_inputs, "fp8-cpu", fp8=True, precision="bf16")
    assert not (stage_inputs / "fp8-cpu.cmf").exists()
