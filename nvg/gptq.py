"""GPTQ (Frantar et al., 2023; IST-DASLab/gptq) for a group-scaled matrix whose scales are already chosen:
the integer codes are picked column by column, and each column's rounding error is spread over the
columns not yet quantised through the inverse of H, so that tr(ΔW H ΔWᵀ) — the output error on the
inputs whose Gram H is — stays small rather than each entry's own error.

nvg uses it for the LM head (the tied embedding): H is the final-normed hidden states' Gram, so the
error counted is the logits', and `damp`·mean(diag H)·I is added for the matrix's other role as the
input embedding, where every direction counts alike. Plain rounding is the damp → ∞ limit.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

BLOCK = 128  # columns per lazy batch update (the GPTQ paper's B)


def gptq_codes(W: np.ndarray, H: np.ndarray, scales: np.ndarray, group: int,
               round_codes: Callable[[torch.Tensor], torch.Tensor], damp: float, device="cpu") -> np.ndarray:
    """Codes [rows, cols] (float-valued integers) with W ≈ codes · scales[:, col // group]; `round_codes`
    maps values in units of the scale to the nearest allowed code. float64 on `device` (the default job's
    encode took 310 s with the SmolLM2 head in q2tp and 259 s with it in f16, on a 2-core CPU)."""
    rows, cols = W.shape
    Wt = torch.from_numpy(np.asarray(W, np.float32)).to(device, torch.float64)
    Hd = torch.from_numpy(np.asarray(H, np.float64)).to(device)
    mean_diag = float(torch.diagonal(Hd).mean()) or 1.0
    Hd = Hd + damp * mean_diag * torch.eye(cols, dtype=torch.float64, device=device)
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
