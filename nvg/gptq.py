"""GPTQ (Frantar et al., 2023; IST-DASLab/gptq) for a group-scaled matrix whose scales are already chosen:
the integer codes are picked column by column, and each column's rounding error is spread over the
columns not yet quantised through the inverse of H, so that tr(ΔW H ΔWᵀ) — the output error on the
inputs whose Gram H is — stays small rather than each entry's own error.

nvg uses it for the LM head (the tied embedding): H is the final-normed hidden states' Gram, so the
error counted is the logits', and `damp`·mean(diag H)·I is added for the matrix's other role as the
input embedding, where every direction counts alike. Plain rounding is the damp → ∞ limit.

GPTQ fixes each column once, on scales chosen before it (absmax). Each refit round (budget_reencode's
`encode.embedding_refit`) then takes the two halves of the same objective in turn: each row's group scales by
least squares with its codes fixed (`least_squares_scales`), then every code by coordinate descent with the
rest fixed (`descended_codes`: each moved to the allowed code nearest its optimum, so the error never rises).
On SmolLM2's q2tp head three rounds halved GPTQ's error on the Gram it fits and lowered it 45 % on held-out
hidden states (docs/quality.md, session 40).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

BLOCK = 128  # columns per lazy batch update (the GPTQ paper's B)


def row_chunk(rows: int, device) -> int:
    """Rows the coordinate descent takes at a time. Rows never interact (each has its own codes and scales; H is
    shared), so on a CPU 1,024 rows run all the sweeps on their own and their float64 residual (4.7 MB at 576
    columns) stays in cache, where the whole matrix's (226 MB for SmolLM2's head) was read and written once a
    column: 8× faster on one core, the same codes. (GPTQ's lazy batch updates already keep its loop in cache: the
    same chunks gained it nothing.) A GPU reads the whole at full bandwidth and would pay a kernel launch a column
    per chunk instead, so it takes every row at once."""
    return rows if torch.device(device).type == "cuda" else 1024


def damped(H: np.ndarray, damp: float, device) -> torch.Tensor:
    """H + damp · mean(diag H) · I, float64 on `device`: the objective's Gram, the embedding's role included."""
    Hd = torch.from_numpy(np.asarray(H, np.float64)).to(device)
    mean_diag = float(torch.diagonal(Hd).mean()) or 1.0
    return Hd + damp * mean_diag * torch.eye(len(Hd), dtype=torch.float64, device=device)


def gptq_codes(W: np.ndarray, H: np.ndarray, scales: np.ndarray, group: int,
               round_codes: Callable[[torch.Tensor], torch.Tensor], damp: float, device="cpu") -> np.ndarray:
    """Codes [rows, cols] (float-valued integers) with W ≈ codes · scales[:, col // group]; `round_codes`
    maps values in units of the scale to the nearest allowed code. float64 on `device` (about 6 s for SmolLM2's
    head on a 2-core CPU)."""
    rows, cols = W.shape
    Wt = torch.from_numpy(np.asarray(W, np.float32)).to(device, torch.float64)
    Hd = damped(H, damp, device)
    # the upper Cholesky factor of H⁻¹: row j holds how column j's error moves the columns after it
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(Hd)), upper=True)
    s = torch.from_numpy(np.asarray(scales, np.float64)).to(device).repeat_interleave(group, dim=1)  # [rows, cols]
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.empty(rows, cols, dtype=torch.float64, device=device)
    for b0 in range(0, cols, BLOCK):
        b1 = min(b0 + BLOCK, cols)
        err = torch.empty(rows, b1 - b0, dtype=torch.float64, device=device)
        for j in range(b0, b1):
            c = round_codes(Wt[:, j] / safe[:, j])
            codes[:, j] = c
            e = (Wt[:, j] - c * s[:, j]) / Hinv[j, j]
            Wt[:, j + 1 : b1] -= e[:, None] * Hinv[j, j + 1 : b1][None, :]
            err[:, j - b0] = e
        Wt[:, b1:] -= err @ Hinv[b0:b1, b1:]
    return codes.cpu().numpy()


def least_squares_scales(W: np.ndarray, H: np.ndarray, codes: np.ndarray, group: int, damp: float,
                         device="cpu") -> tuple[np.ndarray, np.ndarray]:
    """Per row, the group scales s minimising (C s − w) H (C s − w)ᵀ with its codes C fixed (H damped as GPTQ's):
    one groups × groups system a row. Returns the codes with the groups whose best scale is negative negated, and
    the scales [rows, groups], all ≥ 0."""
    rows, cols = W.shape
    G = cols // group
    Hd = damped(H, damp, device)
    blocks = Hd.reshape(G, group, G, group).permute(0, 2, 1, 3)  # [g, h, i, j]: group g's columns against h's
    C = torch.from_numpy(np.asarray(codes, np.float64)).to(device).reshape(rows, G, group)
    WH = (torch.from_numpy(np.asarray(W, np.float64)).to(device) @ Hd).reshape(rows, G, group)
    scales = torch.empty(rows, G, dtype=torch.float64, device=device)
    chunk = max(1, 2**27 // (G * G * group))  # rows at a time: the [chunk, G, G, group] product in 1 GiB
    for r0 in range(0, rows, chunk):
        c = C[r0 : r0 + chunk]
        A = torch.einsum("rghj,rhj->rgh", torch.einsum("rgi,ghij->rghj", c, blocks), c)
        b = torch.einsum("rgi,rgi->rg", c, WH[r0 : r0 + chunk])
        # a zero group (q2tp's all-zero rung) has a zero row and column: a small ridge keeps the system solvable
        ridge = 1e-9 * A.diagonal(dim1=1, dim2=2).mean(1).clamp_min(1e-30)
        A = A + ridge[:, None, None] * torch.eye(G, dtype=torch.float64, device=device)
        scales[r0 : r0 + chunk] = torch.linalg.solve(A, b[..., None])[..., 0]
    sign = torch.where(scales < 0, -1.0, 1.0)
    flipped = (C * sign[..., None]).reshape(rows, cols)
    return flipped.cpu().numpy(), scales.abs().cpu().numpy()


def descended_codes(W: np.ndarray, H: np.ndarray, codes: np.ndarray, scales: np.ndarray, group: int,
                    round_codes: Callable[[torch.Tensor], torch.Tensor], damp: float, sweeps: int,
                    device="cpu") -> np.ndarray:
    """`codes` [rows, cols] after `sweeps` passes of coordinate descent on (C·S − W) H (C·S − W)ᵀ (H damped as
    GPTQ's): column by column, every row's code moves to the allowed code nearest its optimum with the others
    fixed, so no move raises the error; R = (C·S − W) H is kept by a rank-1 update a column."""
    s_all = torch.from_numpy(np.asarray(scales, np.float64)).to(device).repeat_interleave(group, dim=1)
    C_all = torch.tensor(np.asarray(codes), dtype=torch.float64, device=device)  # a copy: the moves never reach `codes`
    W_all = torch.from_numpy(np.asarray(W, np.float64)).to(device)
    Hd = damped(H, damp, device)
    diag = torch.diagonal(Hd)
    # each chunk of rows runs all its sweeps on its own, its residual in cache (`row_chunk`)
    chunk = row_chunk(len(C_all), device)
    for r0 in range(0, len(C_all), chunk):
        s = s_all[r0 : r0 + chunk]
        safe = torch.where(s > 0, s, torch.ones_like(s))
        C = C_all[r0 : r0 + chunk]  # a view: the moves land in C_all
        R = (C * s - W_all[r0 : r0 + chunk]) @ Hd
        for _ in range(sweeps):
            for j in range(C.shape[1]):
                best = round_codes(C[:, j] - R[:, j] / (diag[j] * safe[:, j]))
                move = torch.where(s[:, j] > 0, best - C[:, j], 0.0)  # a zero-scale group's codes stay
                R += (move * s[:, j])[:, None] * Hd[j][None, :]
                C[:, j] += move
    return C_all.cpu().numpy()
