"""A BLR linear's GEMMs in fp8 (`train.fp8`), for Hopper's fp8 tensor cores (twice the bf16 rate).

y = Σ_p h_p ⊙ ((ℓ_p ⊙ ((g_p ⊙ x) S_V,pᵀ)) S_U,pᵀ). The signs are ±1, exact in e4m3, so unlike the folded
bf16 form (`nvg/model.py: BlrLinear`, which multiplies the scales into the sign factors) the scales stay
on the activations and only activations and gradients are rounded: each row (a token) to e4m3 with a
float32 scale of its own, the one that maps its largest entry to e4m3's largest, 448. Per row, not per
tensor, because e4m3's normal range spans only 2⁻⁶ to 448: a token whose activations are far beyond the rest's
(the massive activations entering down_proj) would push every other row into its coarse subnormals.

Four of a path's six GEMMs run in fp8: the forward's two, t = (g ⊙ x) S_Vᵀ and z = (ℓ ⊙ t) S_Uᵀ, and the
input gradient's two, e = (h ⊙ dy) S_U and dx = g ⊙ ((ℓ ⊙ e) S_V). h and g, scales of a GEMM's output
columns, ride in its epilogue as `_scaled_mm`'s column scales, so they cost no pass over the activations.
The two weight-sized gradient GEMMs, M = dyᵀ u and K = (ℓ ⊙ e)ᵀ x, stay in bf16: they reduce over the
tokens, where per-row scales do not apply, and they give the sign gradients (h ⊙ M, K ⊙ g) and the scale
gradients dh = Σ_r S_U ⊙ M and dg = Σ_r S_V ⊙ K in one product each. dℓ = Σ_tokens e ⊙ t is rank-sized.
Saved for backward: x, which autograd keeps for the block's other ops anyway, and t, rank-sized.

`_scaled_mm` needs both dimensions of its second operand divisible by 16: the rank is padded to a multiple
of 16 with zero signs and zero ℓ (the padded columns of t and u are zero and add nothing), and a linear's
own sides must be multiples of 16 (train_student checks; every Llama-family shape is).
On the CPU `mm` is a float32 reference of the same roundings, which is how the tests check the function against
the dense form's autograd and the CUDA tests check the fp8 tensor cores against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
ALIGNMENT = 16  # `_scaled_mm`'s: both sides of its second operand are multiples of it


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as e4m3 codes and a float32 scale per row ([M, 1]): x ≈ codes × scale, each row's largest
    entry at ±448. An all-zero row gets scale 1 (its codes are zero)."""
    amax = x.detach().abs().amax(-1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (x.float() / scale).to(E4M3), scale


def mm(a: torch.Tensor, b_rows: torch.Tensor, col_scale: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] · b_rowsᵀ in fp8 with a's rows rounded (`quantize_rows`) and b_rows [N, K] already e4m3
    (exact ±1 or 0), each output column times `col_scale` [N] (in the epilogue) → bf16 [M, N]. On CUDA the fp8
    tensor cores; elsewhere the reference: the same e4m3 products summed in float32, scaled, rounded to bf16
    (torch's CPU `_scaled_mm` takes one scale per tensor only, up to 2.11 at least)."""
    codes, scale = quantize_rows(a)
    cols = torch.ones(1, b_rows.shape[0], device=a.device) if col_scale is None else col_scale.float()[None, :]
    if a.is_cuda:
        return torch._scaled_mm(codes, b_rows.t(), scale_a=scale, scale_b=cols, out_dtype=torch.bfloat16)
    return ((codes.float() @ b_rows.float().t()) * scale * cols).to(torch.bfloat16)


def has_fp8_matmuls(device: torch.device) -> bool:
    """fp8 tensor cores: CUDA compute capability 8.9 (Ada) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def padded_rank(rank: int) -> int:
    return -(-rank // ALIGNMENT) * ALIGNMENT


class Fp8BlrMatmul(torch.autograd.Function):
    """x [N, d_in] → y [N, d_out] in bf16; h [P, d_out], ell [P, r], g [P, d_in], su [P, d_out, r], sv [P, r, d_in].
    Gradients for every input that asks for one (the signs' only while sign training has them require it)."""

    @staticmethod
    def forward(ctx, x, h, ell, g, su, sv):
        ctx.dtypes = (x.dtype, su.dtype, sv.dtype)
        x = x.to(torch.bfloat16)
        pad = padded_rank(ell.shape[1]) - ell.shape[1]
        su8 = F.pad(su, (0, pad)).to(E4M3)  # [P, d_out, r'], ±1 and the padding's 0, exact
        sv8 = F.pad(sv, (0, 0, 0, pad)).to(E4M3)  # [P, r', d_in]
        ell_p = F.pad(ell, (0, pad))
        y, ts = None, []
        for p in range(h.shape[0]):
            t = mm(x * g[p].to(x.dtype), sv8[p])  # [N, r']
            z = mm(t * ell_p[p].to(t.dtype), su8[p], h[p])  # [N, d_out], h in the epilogue
            y = z if y is None else y + z
            ts.append(t)
        ctx.save_for_backward(x, h, ell_p, g, su8, sv8, torch.stack(ts))
        ctx.rank = ell.shape[1]
        return y

    @staticmethod
    def backward(ctx, dy):
        x, h, ell_p, g, su8, sv8, ts = ctx.saved_tensors
        r = ctx.rank
        dy = dy.to(torch.bfloat16)
        need_x, need_h, need_ell, need_g, need_su, need_sv = ctx.needs_input_grad
        dx = None
        grads = {k: [] for k in ("h", "ell", "g", "su", "sv")}
        for p in range(h.shape[0]):
            su_t = su8[p].t().contiguous()  # [r', d_out]: S_U as the second operand of e = (h ⊙ dy) S_U
            sv_t = sv8[p].t().contiguous()  # [d_in, r']
            e = mm(dy * h[p].to(dy.dtype), su_t)  # [N, r']: the gradient of u = ℓ ⊙ t
            de = e * ell_p[p].to(e.dtype)  # the gradient of t
            if need_x:
                dxp = mm(de, sv_t, g[p])  # g in the epilogue
                dx = dxp if dx is None else dx + dxp
            if need_ell:
                grads["ell"].append((e.float() * ts[p].float()).sum(0)[:r])
            if need_h or need_su:
                u = (ts[p] * ell_p[p].to(ts.dtype))
                m = (dy.t() @ u)[:, :r].float()  # [d_out, r]
                grads["h"].append((m * su8[p, :, :r].float()).sum(1))
                grads["su"].append(m * h[p][:, None])
            if need_g or need_sv:
                k = (de.t() @ x)[:r].float()  # [r, d_in]
                grads["g"].append((k * sv8[p, :r].float()).sum(0))
                grads["sv"].append(k * g[p][None, :])
        stacked = lambda key, need, dtype=torch.float32: torch.stack(grads[key]).to(dtype) if need else None  # noqa: E731
        x_dtype, su_dtype, sv_dtype = ctx.dtypes
        return (dx.to(x_dtype) if need_x else None, stacked("h", need_h), stacked("ell", need_ell), stacked("g", need_g),
                stacked("su", need_su, su_dtype), stacked("sv", need_sv, sv_dtype))


def blr_matmul(x: torch.Tensor, h, ell, g, su, sv) -> torch.Tensor:
    """`Fp8BlrMatmul` over x's last dimension, any leading dimensions."""
    y = Fp8BlrMatmul.apply(x.reshape(-1, x.shape[-1]), h, ell, g, su, sv)
    return y.reshape(*x.shape[:-1], y.shape[-1])
