"""The encoder's sign refinement: exact coordinate-descent sweeps over the signs of S_U, and of S_V.

For every output row o the signs s = S_U[o, :] minimise h_o² sᵀ G s − 2 h_o sᵀ c_o with
G = M H Mᵀ and c_o = M H t_o. Flipping s_k changes that objective by
    δ_k = 4 h_o² (G_kk − s_k (G s)_k) + 4 h_o s_k c_ok,
so column after column a sign flips where δ_k < 0, and the running product G s is updated by
−2 s_k G[k, :]. The rows are independent problems; only the columns within a row are sequential.

* CUDA (`_sweep_kernel`, Triton): one program per row keeps its signs, c and G s in registers and walks
  the r columns in one launch. The same sweep as tensor ops is r dependent steps of a few kernels each,
  which is kernel-launch bound on an H200 (87.8 ms for [1536, 256] measured, docs/encoder.md).
* CPU (`_sweep_cpu`, numpy float64): vectorised over rows, column-major; within a block of columns a
  column's G s is formed when it is reached, and the block's flips reach G s with one matrix product.
Both are exact in float64 and give the same signs (tests/test_gpu_fast_paths.py on the device).

S_V (`flip_v_signs`) is the same problem a row at a time: with A = diag(h) S_U diag(ℓ), P = Aᵀρ A and
M = diag(g) H diag(g), row k of S_V minimises P_kk vᵀ M v − 2 vᵀ c_k, c_k = g ⊙ ((Aᵀρ T − P° X) H)_k
(X = S_V diag(g), P° = P without its diagonal): the U sweep with h_o → √P_kk and G → M. Unlike the rows
of S_U, the rows of S_V are coupled through P°, so they are swept in `groups` interleaved groups, and c
is brought up to date between groups; the caller keeps the sweep only if it lowered the objective.
"""

from __future__ import annotations

import numpy as np
import torch

try:  # bundled with CUDA builds of torch; absent from CPU-only installs, which never need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def flip_u_signs(su: torch.Tensor, h: torch.Tensor, G: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """S_U [o, r] after one sweep (same device and dtype as `su`); h [o], G [r, r], c [o, r]."""
    if su.is_cuda and triton is not None:
        return _sweep_cuda(su, h, G, c)
    return _sweep_cpu(su, h, G, c)


def flip_v_signs(sv: torch.Tensor, a: torch.Tensor, g: torch.Tensor, target: torch.Tensor, H: torch.Tensor,
                 rho: torch.Tensor, groups: int = 8) -> torch.Tensor:
    """S_V [r, i] after one sweep; a = diag(h) S_U diag(ℓ) [o, r], g [i], target [o, i], H [i, i], ρ [o]."""
    P = a.T @ (rho[:, None] * a)
    coupling = P - torch.diag(P.diagonal())
    M = (g[:, None] * H * g[None, :]).double()  # once, not once a group (the CPU sweep works in float64)
    aT = (a * rho[:, None]).T @ target
    root = P.diagonal().clamp_min(1e-30).sqrt()
    sv = sv.clone()
    for first in range(groups):
        rows = torch.arange(first, len(sv), groups, device=sv.device)
        c = ((aT[rows] - coupling[rows] @ (sv * g[None, :])) @ H) * g[None, :]
        sv[rows] = flip_u_signs(sv[rows], root[rows], M, c / root[rows, None])
    return sv


def _sweep_cpu(su, h, G, c, block: int = 32) -> torch.Tensor:
    # Column-major copies ([r, o]): a step reads one contiguous row. δ_k < 0 is s_k · 4 h_o (c_ok − h_o (G s)_k)
    # < −4 h_o² G_kk, with 4 h c and the right side precomputed for all columns: a step is seven numpy calls
    # on o-vectors, and G s of column k is formed when k is reached (its block's flips so far, one small
    # product) instead of every column of the block being brought up to date after each step. On S_V's
    # groups of r/8 rows the per-call overhead, not the arithmetic, is the cost (docs/encoder.md).
    st = np.ascontiguousarray(su.double().cpu().numpy().T)
    hh, G64 = h.double().cpu().numpy(), G.double().cpu().numpy()
    h2x4 = 4 * hh * hh
    hct = np.ascontiguousarray(c.double().cpu().numpy().T) * (4 * hh)  # 4 h_o c_ok
    threshold = np.multiply.outer(np.diag(G64), -h2x4)  # flip k of row o where s_k (4 h c − 4 h² (G s)_k) < this
    gst = G64 @ st  # [r, o]: (G s) of every row, transposed (G is symmetric)
    for start in range(0, st.shape[0], block):
        stop = min(start + block, st.shape[0])
        change = np.zeros((stop - start, st.shape[1]))  # −2 s where a sign flipped, else 0
        minus_two_s = -2 * st[start:stop]
        for j, k in enumerate(range(start, stop)):
            gs_k = gst[k] + G64[k, start:k] @ change[:j]
            q = hct[k] - h2x4 * gs_k
            q *= st[k]
            np.multiply(q < threshold[k], minus_two_s[j], out=change[j])
        st[start:stop] += change
        gst += G64[:, start:stop] @ change
    return torch.from_numpy(st.T.copy()).to(su.device, su.dtype)


def _sweep_cuda(su, h, G, c) -> torch.Tensor:
    o, r = su.shape
    s = su.double().contiguous()
    G64 = G.double().contiguous()
    gs = (s @ G64).contiguous()
    _sweep_kernel[(o,)](s, gs, G64, c.double().contiguous(), h.double().contiguous(), r,
                        BLOCK=triton.next_power_of_2(r))
    return s.to(su.dtype)


if triton is not None:

    @triton.jit
    def _sweep_kernel(S, GS, G, C, H, r, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        live = cols < r
        base = row * r
        s = tl.load(S + base + cols, mask=live, other=0.0)
        gs = tl.load(GS + base + cols, mask=live, other=0.0)
        c = tl.load(C + base + cols, mask=live, other=0.0)
        h = tl.load(H + row)
        for k in range(0, r):
            at_k = cols == k
            sk = tl.sum(tl.where(at_k, s, 0.0), axis=0)
            gk = tl.sum(tl.where(at_k, gs, 0.0), axis=0)
            ck = tl.sum(tl.where(at_k, c, 0.0), axis=0)
            gkk = tl.load(G + k * r + k)
            delta = 4.0 * h * h * (gkk - sk * gk) + 4.0 * h * sk * ck
            change = tl.where(delta < 0.0, -2.0 * sk, 0.0)
            gs += change * tl.load(G + k * r + cols, mask=live, other=0.0)
            s = tl.where(at_k, s + change, s)
        tl.store(S + base + cols, s, mask=live)
