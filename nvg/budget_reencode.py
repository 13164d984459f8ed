"""Stage `budget_reencode`: encode every body linear into BLR at its planned bits per weight.

The target is the teacher's weight W; the metric is the input Gram: E(Ŵ) = tr((W − Ŵ) H (W − Ŵ)ᵀ)
with H = H_fit + λ·mean(diag H_fit)·I. Rank r is the largest multiple of 8 whose payload fits the
budget. Methods:

* `dual-svid` — LittleBit's data-free baseline: truncated SVD, signs of the balanced factors, rank-1
  fits of their magnitudes, a residual second path. Kept for comparison.
* `nvg` (default) — data-aware: the SVD of the whitened weight W·L (H = L·Lᵀ) gives the signs, then
  alternating closed-form least-squares fits of h, ℓ, g under H and an exact coordinate-descent
  refinement of the U signs, path by path.

P = 1, 2 or auto (auto keeps the lower relative SEL error at equal budget). Given an existing student,
only tensors whose planned (P, r) differs are re-encoded; every other payload is copied byte for byte.

    python -m nvg.budget_reencode --teacher T.cmf --grams G.h5 [--plan P] [--student S.cmf] \
        --out encoded.cmf --report encode.json --settings JSON
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from nvg import blr as codec
from nvg.atomic import write_json
from nvg.cmf import BLR, Tensor, read_cmf, tensor_to_numpy, write_cmf
from nvg.cli import bits_summary
from nvg.errors import NvgError, exits_cleanly
from nvg.gram_capture import read_grams
from nvg.model import ROLE_INPUT, parse_body_linear, pick_device
from nvg.plan import read_plan
from nvg.settings import check, from_json
from nvg.sign_sweep import flip_u_signs


@dataclass
class EncodeSettings:
    bpw: float = 1.0
    method: str = "nvg"
    paths: str = "auto"
    kv_factor: float = 1.0
    rowweight: bool = False
    damp: float = 0.01
    iters: int = 2
    device: str = "auto"

    def __post_init__(self):
        check(0 < self.bpw <= 16, "encode", "bpw", f"must be in (0, 16], got {self.bpw}")
        check(self.method in ("nvg", "dual-svid"), "encode", "method", f"'nvg' or 'dual-svid', got {self.method!r}")
        check(self.paths in ("1", "2", "auto"), "encode", "paths", f"'1', '2' or 'auto', got {self.paths!r}")
        check(self.kv_factor > 0, "encode", "kv_factor", f"must be > 0, got {self.kv_factor}")
        check(self.damp >= 0, "encode", "damp", f"must be >= 0, got {self.damp}")
        check(self.iters >= 0, "encode", "iters", f"must be >= 0, got {self.iters}")


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


def _solve(m: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    ridge = 1e-9 * m.diagonal().abs().mean().clamp_min(1e-30)
    return torch.linalg.solve(m + ridge * torch.eye(len(m), dtype=m.dtype, device=m.device), rhs)


def refine_path(f, target, H, rho, iters: int):
    """Alternating closed-form fits of h, ℓ, g under E = Σ_o ρ_o (t_o − ŵ_o) H (t_o − ŵ_o)ᵀ and exact
    coordinate descent on the U signs (each row of S_U is a small binary quadratic problem)."""
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
        ell = _solve((a.T @ (rho[:, None] * a)) * (bh @ b.T), ((a * rho[:, None]).T @ TH * b).sum(1))
        # g: (Nᵀ ρ N ∘ H) g = diag(Nᵀ ρ T H)
        n = (a * ell) @ sv
        g = _solve((n.T @ (rho[:, None] * n)) * H, ((n * rho[:, None]) * TH).sum(0))
        # U signs: per row minimise h_o² sᵀ G s − 2 h_o sᵀ c_o, G = M H Mᵀ, c_o = M H t_o; M = diag(ℓ) S_V diag(g)
        mm = ell[:, None] * sv * g[None, :]
        mmh = mm @ H
        su = flip_u_signs(su, h, mmh @ mm.T, TH @ mm.T)
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
    for paths in ((1, 2) if s.paths == "auto" else (int(s.paths),)):
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
                    factors[p] = refine_path(factors[p], Wt - others, H, rho, s.iters)
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


def main(teacher: Path, grams: Path, out: Path, report: Path, settings: EncodeSettings,
         plan_path: Path | None = None, student: Path | None = None) -> None:
    plan = read_plan(plan_path, settings.bpw)  # plan errors come before any model is read
    t_cmf = read_cmf(teacher)
    arch = t_cmf.arch
    body = [n for n in t_cmf.tensors if parse_body_linear(n)]
    plan.check_against(arch["num_layers"], body)
    s_cmf = read_cmf(student) if student else None
    device = pick_device(settings.device)
    t0 = time.perf_counter()
    payloads, rows = {}, {}
    for name in body:
        layer, role = parse_body_linear(name)
        bpw = plan.bpw_for(name, layer, settings.bpw) * (settings.kv_factor if role in ("k", "v") else 1.0)
        shape = t_cmf.tensors[name].shape
        if s_cmf is not None and s_cmf.tensors.get(name) is not None and s_cmf.tensors[name].dtype == BLR:
            cur = codec.parse_header(bytes(s_cmf.tensors[name].data[:16]))
            if codec.max_rank(bpw, cur.paths, *shape) == cur.rank:
                payloads[name] = s_cmf.tensors[name].data  # budget unchanged: byte-identical
                rows[name] = {"method": "kept", "rank": cur.rank, "paths": cur.paths,
                              "bpw": codec.bits_per_weight(cur.paths, cur.rank, *shape), "planned_bpw": bpw}
                continue
        H_fit, H_sel, _, _ = read_grams(grams, layer, ROLE_INPUT[role])
        W = tensor_to_numpy(t_cmf.tensors[name])
        blr, row = encode_tensor(W, H_fit, H_sel, bpw, role, arch["head_dim"], settings, device, name)
        payloads[name] = blr.encode()
        rows[name] = row
        print(f"  {name}: P={row['paths']} r={row['rank']} {row['bpw']:.4f} bpw, rel SEL error {row['rel_sel_error']:.4f}",
              file=sys.stderr)
    base = s_cmf or t_cmf
    tensors = []
    for name, t in base.tensors.items():
        if name in payloads:
            tensors.append(Tensor(name, BLR, t.shape, payloads[name]))
        else:
            tensors.append(Tensor(name, t.dtype, t.shape, t.data))
    header = dict(base.header)
    prov = dict(header.get("provenance", {}))
    prov["nvg_encode"] = {"method": settings.method, "bpw": settings.bpw, "paths": settings.paths,
                          "kv_factor": settings.kv_factor, "plan": str(plan_path) if plan_path else None,
                          "reencoded": sum(r["method"] != "kept" for r in rows.values())}
    header["provenance"] = prov
    header["quant_type"] = "BLR"
    write_cmf(out, header, tensors, base.vocab)
    totals = bits_summary(read_cmf(out))
    errs = [r["rel_sel_error"] for r in rows.values() if "rel_sel_error" in r]
    write_json(report, {
        "settings": vars(settings), "plan": str(plan_path) if plan_path else None,
        "seconds": time.perf_counter() - t0, "device": str(device),
        "mean_rel_sel_error": float(np.mean(errs)) if errs else None,
        "body_bpw": totals["body_bpw"], "file_bpw": totals["file_bpw"], "tensors": rows,
    })
    print(f"budget_reencode: {len(rows)} linears, body {totals['body_bpw']:.4f} bpw, file {totals['file_bpw']:.4f} bpw, "
          f"mean rel SEL error {np.mean(errs) if errs else float('nan'):.4f}, {time.perf_counter() - t0:.0f}s → {out}",
          file=sys.stderr)


@exits_cleanly
def cli(argv=None):
    ap = argparse.ArgumentParser(prog="nvg budget-reencode", description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", required=True, type=Path)
    ap.add_argument("--grams", required=True, type=Path)
    ap.add_argument("--plan", type=Path, default=None)
    ap.add_argument("--student", type=Path, default=None)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--report", required=True, type=Path)
    ap.add_argument("--settings", required=True)
    a = ap.parse_args(argv)
    main(a.teacher, a.grams, a.out, a.report, from_json(EncodeSettings, a.settings, "encode"), a.plan, a.student)


if __name__ == "__main__":
    cli()
