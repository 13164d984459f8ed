"""y = x·Wᵀ for a BLR weight W = Σ_p diag(h_p) S_U,p diag(ℓ_p) S_V,p diag(g_p) whose signs are frozen,
with a backward pass that costs two GEMMs instead of autograd's four.

Autograd through the folded form y = (x Aᵀ) Bᵀ computes dA and dB, two weight-sized GEMMs, only to
reduce them to the scale gradients. Every scale gradient is available from activations instead
(per path p, v_p = (x ⊙ g_p) S_V,pᵀ the rank-sized code, z_p = (v_p ⊙ ℓ_p) S_U,pᵀ the output before h):

    dh_p = Σ_t dy ⊙ z_p          du_p = (dy ⊙ h_p) S_U,p       (GEMM 1, also needed for dx)
    dℓ_p = Σ_t du_p ⊙ v_p        w_p  = (du_p ⊙ ℓ_p) S_V,p     (GEMM 2, also needed for dx)
    dg_p = Σ_t x ⊙ w_p           dx   = Σ_p w_p ⊙ g_p

so backward is the input gradient's two GEMMs plus elementwise reductions (fused by inductor when
the block is compiled). Saved for backward: x, v (rank-sized) and z (output-sized, one per path).
The ±1 signs are exact in bf16, so the GEMMs run on tensor cores in the autocast dtype; the scale
gradients are reduced in float32."""

from __future__ import annotations

import torch


class BlrScalesMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h, ell, g, su, sv, dtype):
        # x [.., d_in]; h [P, d_out]; ell [P, r]; g [P, d_in]; su [P, d_out, r]; sv [P, r, d_in]
        lead = x.shape[:-1]
        xf = x.reshape(-1, x.shape[-1]).to(dtype)
        su_t, sv_t = su.to(dtype), sv.to(dtype)
        v = torch.matmul(xf.unsqueeze(0) * g.to(dtype).unsqueeze(1), sv_t.transpose(1, 2))  # [P, T, r]
        z = torch.matmul(v * ell.to(dtype).unsqueeze(1), su_t.transpose(1, 2))  # [P, T, d_out]
        y = (z * h.to(dtype).unsqueeze(1)).sum(0)
        ctx.save_for_backward(xf, v, z, h, ell, g, su_t, sv_t)
        ctx.lead = lead
        return y.reshape(*lead, -1)

    @staticmethod
    def backward(ctx, dy):
        xf, v, z, h, ell, g, su_t, sv_t = ctx.saved_tensors
        dt = xf.dtype
        acc = torch.promote_types(dt, torch.float32)  # the scale gradients sum over every token
        dy = dy.reshape(-1, dy.shape[-1]).to(dt)
        dh = torch.einsum("td,ptd->pd", dy.to(acc), z.to(acc))
        du = torch.matmul(dy.unsqueeze(0) * h.to(dt).unsqueeze(1), su_t)  # [P, T, r]
        dell = torch.einsum("ptr,ptr->pr", du.to(acc), v.to(acc))
        w = torch.matmul(du * ell.to(dt).unsqueeze(1), sv_t)  # [P, T, d_in]
        dg = torch.einsum("ti,pti->pi", xf.to(acc), w.to(acc))
        dx = (w * g.to(dt).unsqueeze(1)).sum(0)
        return dx.reshape(*ctx.lead, -1), dh.to(h.dtype), dell.to(ell.dtype), dg.to(g.dtype), None, None, None


def blr_scales_matmul(x, h, ell, g, su, sv) -> torch.Tensor:
    """x·Wᵀ in the autocast dtype (or x's), gradients for x, h, ℓ and g only."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    with torch.autocast(x.device.type, enabled=False):
        return BlrScalesMatmul.apply(x, h, ell, g, su, sv, dtype)
