"""The scales-only BLR matmul: output and every gradient equal autograd through the dense weight."""

from __future__ import annotations

import pytest
import torch

from nvg.blr_matmul import blr_scales_matmul


def factors(paths, d_out=24, rank=8, d_in=16, dtype=torch.float64):
    g = torch.Generator().manual_seed(paths)
    h, ell, gi = (torch.randn(paths, n, dtype=dtype, generator=g).requires_grad_() for n in (d_out, rank, d_in))
    su = torch.randn(paths, d_out, rank, dtype=dtype, generator=g).sign()
    sv = torch.randn(paths, rank, d_in, dtype=dtype, generator=g).sign()
    return h, ell, gi, su, sv


@pytest.mark.parametrize("paths", [1, 2])
def test_output_and_every_gradient_equal_autograd_on_the_dense_weight(paths):
    h, ell, g, su, sv = factors(paths)
    x = torch.randn(3, 10, 16, dtype=torch.float64, requires_grad=True)
    dense = x @ torch.einsum("po,por,pr,pri,pi->oi", h, su, ell, sv, g).T
    ours = blr_scales_matmul(x, h, ell, g, su, sv)
    assert torch.allclose(ours, dense, atol=1e-12)
    dy = torch.randn_like(dense)
    for a, b in zip(torch.autograd.grad(dense, (x, h, ell, g), dy), torch.autograd.grad(ours, (x, h, ell, g), dy)):
        assert torch.allclose(a, b, atol=1e-10), (a - b).abs().max()
    assert torch.autograd.gradcheck(lambda *t: blr_scales_matmul(*t, su, sv), (x, h, ell, g))


def test_the_student_trains_its_scales_through_it_and_signs_through_autograd(tiny_stages):
    from nvg.model import load_model

    model = load_model(tiny_stages / "student.cmf")
    lin = next(iter(model.blr_linears().values()))
    for p in (lin.h, lin.ell, lin.g):
        p.requires_grad_(True)
    x = torch.randn(2, 5, lin.g.shape[1])
    y = lin(x)
    assert type(y.grad_fn).__name__ == "BlrScalesMatmulBackward"
    dense = x @ lin.dense_weight().T
    assert torch.allclose(y, dense, atol=1e-4)
    lin.su.requires_grad_(True)  # sign training: the signs need their gradients, so autograd's path
    assert type(lin(x).grad_fn).__name__ != "BlrScalesMatmulBackward"
    with torch.no_grad():  # inference: the folded two-GEMM forward
        assert torch.allclose(lin(x), dense, atol=1e-4)
