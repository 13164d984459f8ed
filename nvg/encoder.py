"""The BLR encoder: one teacher weight W → binary low-rank factors at a budget, under its input Gram.

The target is W; the metric is the input Gram: E(Ŵ) = tr((W − Ŵ) H (W − Ŵ)ᵀ) with
H = H_fit + λ·mean(diag H_fit)·I. Rank r is the largest multiple of 8 whose payload fits the budget.
Methods:

* `dual-svid` — LittleBit's data-free baseline: truncated SVD, signs of the balanced factors, rank-1
  fits of their magnitudes, a residual second path. Kept for comparison.
* `nvg` (default) — data-aware: the SVD of the whitened weight W·L (H = L·Lᵀ) gives the signs, then
  alternating closed-form least-squares fits of h, ℓ, g under H and exact coordinate-descent
  refinements of the U signs, and with `signs: uv` of the V signs too (`sign_sweep.py`), path by path.

P = 1, 2 or auto (auto keeps the lower relative SEL error at equal budget). The stage driver that
walks a model's tensors is `budget_reencode.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from nvg import blr as codec
from nvg.errors import NvgError
from nvg.sign_sweep import flip_u_signs, flip_v_signs


@dataclass
class EncodeSettings:
    """Config block `encode` (defaults and bounds: the schema; build with `nvg.settings.load`)."""

    SECTION: ClassVar[str] = "encode"
    bpw: float
    ends_factor: float
    fill: bool
    method: str
    paths: str
    kv_factor: float
    rowweight: bool
    damp: float
    iters: int
    signs: str
    v_groups: int
    embedding: str
    embedding_bpw: float
    embedding_damp: float
    embedding_shrink: bool
    embedding_refit: int
    device: str


# ── one path's factors: h [o], ℓ [r], g [i], su [o, r] ±1, sv [r, i] ±1 (float64 on the device) ──

def path_weight(f) -> torch.Tensor:
    h, ell, g, su, sv = f
    return (h[:, None] * su * ell[None, :]) @ (sv * g[None, :])


def _rank1_abs(m: torch.Tensor, iters: int = 30) -> tuple[torch.Tensor, torch.Tensor]:
    """Nonnegative rank-1 fit |m| ≈ a bᵀ by power iteration (a dense SVD per fit is slow on the GPU)."""
    m = m.abs()
    b = m.mean(0)
    for _ in range(iters):
        a = m @ b
        b = m.T @ a
        b = b / b.norm().clamp_min(1e-30)
    a = m @ b  # |m| b with ‖b‖ = 1: the top singular pair, scale split evenly below
    sigma = a.norm().clamp_min(1e-30)
    return a / sigma * sigma.sqrt(), b * sigma.sqrt()


def top_singular(x: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-r singular triplets (u [o, r], s [r], v [i, r]) from the eigendecomposition of the smaller
    Gram matrix in float64: one eigh instead of a full SVD, which is several times faster on the GPU."""
    wide = x.shape[0] <= x.shape[1]
    x64 = x.double()
    evals, evecs = torch.linalg.eigh(x64 @ x64.T if wide else x64.T @ x64)
    s = evals.flip(0)[:r].clamp_min(0).sqrt()
    lead = evecs.flip(1)[:, :r]
    other = (x64.T @ lead if wide else x64 @ lead) / s.clamp_min(1e-30)
    u, v = (lead, other) if wide else (other, lead)
    return u.to(x.dtype), s.to(x.dtype), v.to(x.dtype)


def _signs(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)


def dual_svid_path(target: torch.Tensor, r: int):
    """LittleBit's Dual-SVID init for one path."""
    u, s, v = top_singular(target, r)
    a = u * s.sqrt()
    b = v * s.sqrt()  # [i, r]
    h, la = _rank1_abs(a)
    g, lb = _rank1_abs(b)
    return [h, la * lb, g, _signs(a), _signs(b).T.contiguous()]


def whitened_path(target: torch.Tensor, r: int, chol: torch.Tensor):
    """Signs from the best rank-r approximation under H (the SVD of target·L), magnitudes rank-1."""
    u, s, v = top_singular(target @ chol, r)
    a = u * s.sqrt()
    b = torch.linalg.solve_triangular(chol.T, v * s.sqrt(), upper=True)  # L⁻ᵀ B̃: [i, r]
    h, la = _rank1_abs(a)
    g, lb = _rank1_abs(b)
    return [h, la * lb, g, _signs(a), _signs(b).T.contiguous()]


def ridge_solve(m: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """m⁻¹·rhs with a relative ridge of 1e-9 (a rank-deficient Gram still solves)."""
    ridge = 1e-9 * m.diagonal().abs().mean().clamp_min(1e-30)
    return torch.linalg.solve(m + ridge * torch.eye(len(m), dtype=m.dtype, device=m.device), rhs)


def v_sweep_change(a, rho, TH, H, g, old, new) -> torch.Tensor:
    """E(new S_V) − E(old S_V) for the path ŵ = a · S_V · diag(g), a = diag(h) S_U diag(ℓ), with TH = T H.
    With D = (new − old) diag(g): ΔE = −2 ⟨Aᵀ ρ T H, D⟩ + ⟨Aᵀ ρ A, D H (B_new + B_old)ᵀ⟩, which costs
    r · d_in² where evaluating E twice costs d_out · d_in² each time, and is the difference itself rather
    than that of two large float32 sums."""
    d = (new - old) * g
    ar = a * rho[:, None]
    return -2 * (ar.T @ TH * d).sum() + ((ar.T @ a) * ((d @ H) @ ((new + old) * g).T)).sum()


def refine_path(f, target, H, rho, iters: int, v_signs: bool, v_groups: int):
    """Alternating closed-form fits of h, ℓ, g under E = Σ_o ρ_o (t_o − ŵ_o) H (t_o − ŵ_o)ᵀ and exact
    coordinate descent on the U signs (each row of S_U is a small binary quadratic problem); with
    `v_signs`, then on the V signs in `v_groups` groups, kept where they lower E (their rows are coupled;
    `flip_v_signs`)."""
    h, ell, g, su, sv = f
    TH = target @ H
    for _ in range(iters):
        # h: per row, h_o = ⟨t_o, m_o⟩_H / ⟨m_o, m_o⟩_H
        m = (su * ell) @ (sv * g)
        mh = m @ H
        h = (TH * m).sum(1) / (mh * m).sum(1).clamp_min(1e-30)
        # ℓ: (Aᵀ ρ A ∘ B H Bᵀ) ℓ = diag(Aᵀ ρ T H Bᵀ)
        a = h[:, None] * su
        b = sv * g
        bh = b @ H
        ell = ridge_solve((a.T @ (rho[:, None] * a)) * (bh @ b.T), ((a * rho[:, None]).T @ TH * b).sum(1))
        # g: (Nᵀ ρ N ∘ H) g = diag(Nᵀ ρ T H)
        n = (a * ell) @ sv
        g = ridge_solve((n.T @ (rho[:, None] * n)) * H, ((n * rho[:, None]) * TH).sum(0))
        # U signs: per row minimise h_o² sᵀ G s − 2 h_o sᵀ c_o, G = M H Mᵀ, c_o = M H t_o; M = diag(ℓ) S_V diag(g)
        mm = ell[:, None] * sv * g[None, :]
        mmh = mm @ H
        su = flip_u_signs(su, h, mmh @ mm.T, TH @ mm.T)
        if v_signs:
            a = h[:, None] * su * ell[None, :]
            swept = flip_v_signs(sv, a, g, target, H, rho, v_groups)
            if v_sweep_change(a, rho, TH, H, g, sv, swept) < 0:
                sv = swept
    return [h, ell, g, su, sv]


def damped(H: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """H + λ·mean(diag H)·I and its Cholesky factor; λ grows ×10 until the factorisation succeeds."""
    lam = max(damp, 1e-6)
    mean = H.diagonal().mean().clamp_min(1e-12)
    eye = torch.eye(len(H), dtype=H.dtype, device=H.device)
    while lam <= 1.0:
        Hd = H + lam * mean * eye
        chol, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            return Hd, chol
        lam *= 10
    raise NvgError("Gram matrix is not positive definite even with damping 1.0")


def rel_error(W, What, H) -> float:
    d = W - What
    return float(((d @ H) * d).sum() / ((W @ H) * W).sum().clamp_min(1e-30))


def row_weights(W, H, role: str, head_dim: int, rowweight: bool) -> torch.Tensor:
    """ρ per output row: with `rowweight`, q/k/v rows are weighted so each head's rows count equally."""
    rho = torch.ones(W.shape[0], dtype=W.dtype, device=W.device)
    if not rowweight or role not in ("q", "k", "v") or W.shape[0] % head_dim:
        return rho
    energy = ((W @ H) * W).sum(1).view(-1, head_dim).mean(1)
    per_head = energy.mean() / energy.clamp_min(1e-30)
    return per_head.repeat_interleave(head_dim)


def encode_tensor(W: np.ndarray, H_fit: np.ndarray, H_sel: np.ndarray, bpw: float, role: str, head_dim: int,
                  s: EncodeSettings, device, name: str) -> tuple[codec.BlrTensor, dict]:
    d_out, d_in = W.shape
    if d_in % 8:
        raise NvgError(f"{name}: d_in {d_in} is not a multiple of 8, which BLR needs")
    Wt = torch.from_numpy(W).to(device, torch.float32)
    Hs = torch.from_numpy(H_sel).to(device, torch.float32)
    H, chol = damped(torch.from_numpy(H_fit).to(device, torch.float32), s.damp)
    rho = row_weights(Wt, H, role, head_dim, s.rowweight)
    best = None
    for paths in codec.path_counts(bpw, s.paths, d_out, d_in):
        r = codec.max_rank(bpw, paths, d_out, d_in)
        if r < 8:
            continue
        factors = []
        residual = Wt.clone()
        for _ in range(paths):
            f = dual_svid_path(residual, r) if s.method == "dual-svid" else whitened_path(residual, r, chol)
            factors.append(f)
            residual = residual - path_weight(f)
        if s.method == "nvg":
            for _ in range(max(1, s.iters // 2) if paths > 1 else 1):  # block coordinate descent over paths
                for p in range(paths):
                    others = sum((path_weight(factors[q]) for q in range(paths) if q != p), torch.zeros_like(Wt))
                    factors[p] = refine_path(factors[p], Wt - others, H, rho, s.iters, s.signs == "uv", s.v_groups)
        blr = codec.BlrTensor.from_factors([[x.cpu().numpy() for x in (f[0], f[2], f[1], f[3], f[4])] for f in factors])
        What = torch.from_numpy(blr.dequantize()).to(device, torch.float32)  # as stored: f16 scales
        err = rel_error(Wt, What, Hs)
        if best is None or err < best[1]["rel_sel_error"]:
            best = (blr, {"method": s.method, "rank": r, "paths": paths, "bpw": blr.bits_per_weight,
                          "planned_bpw": bpw, "rel_sel_error": err,
                          "rel_fit_error": rel_error(Wt, What, torch.from_numpy(H_fit).to(device, torch.float32))})
    if best is None:
        need = codec.bits_per_weight(1, 8, d_out, d_in)
        raise NvgError(f"{name}: {bpw:.4f} bpw cannot hold even rank 8 (the minimum is {need:.4f} bpw)")
    return best
