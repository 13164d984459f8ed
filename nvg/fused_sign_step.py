"""The factored optimizer's sign step (`nvg.sign_training.latent_step`) on CUDA in three passes over the bucket.

Why: the tensor-op form of one bucket's step is about thirty weight-sized elementwise kernels (the non-finite
mask, the gradient clip's copy, the moment's lerp and bf16 round trip, the factored second moment's outer
product, the update clip, the clamp, the hysteresis), each a full read and write of [n, R, C] floats: on the
H200 the sign step lost 11–13 % of its rate to them since session 14 (docs/benchmarks.md). Here each sign is
read three times and written twice, about 30 bytes in all:

  A `_square_sums`   reads g: per tile, its rows' and columns' sums of g² and its count of non-finite values.
                     Between A and B, in rank-sized tensor ops: the gradient clip's scale per matrix, the
                     factored second moment's row and column means (v_row, v_col) brought up to date.
  B `_moment_rms`    reads g and m (bf16), writes m: the first moment's update; the partial sums of the
                     step's square, for each matrix's RMS (the update clip needs it before any latent moves).
  C `_latent_update` reads m, z and the bits, writes z and the bits; counts flips, saturated and clamped latents.

The arithmetic is the tensor-op form's, in the same order, so the two agree to float rounding (tests in Triton's
CPU interpreter and on the device); the tile partial sums are added by torch in a fixed order, so a step is
deterministic. Everything per matrix (η, the slope, the clip scales) stays on the device: no host
synchronisation inside the backward pass. Measured on the H200 (sessions 31 and 32, docs/benchmarks.md): 1.0 GB
less at the training step's peak on SmolLM2 and 6 % less GPU time a step, but slower by the clock (6-29 %) where the
step is host-bound: the ~60 rank-sized tensor ops a bucket around the three launches are host calls too.
"""

from __future__ import annotations

import torch

try:  # bundled with CUDA builds of torch; absent from CPU-only installs, which never need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK_R, BLOCK_C = 32, 128  # a tile: 4,096 signs a program, hundreds of programs for SmolLM2's buckets


def factored_step(g, p, st: dict, scalars, b1: float, b2: float, eps: float, hyst: float, clamp: float,
                  update_clip: float, grad_clip: float):
    """`latent_step("factored", …)` for CUDA tensors: same arguments and results. g, p, z and m are n matrices
    [n, …, R, C]; a matrix with more than two dimensions (P paths: [P, R, C]) is P factored blocks [R, C], each
    with its own row and column means, under one clip and one RMS, as in the tensor-op form."""
    n, (R, C) = g.shape[0], g.shape[-2:]
    blocks = g[0].numel() // (R * C)  # factored blocks a matrix
    nb = n * blocks
    g, z, m, bits = (t.reshape(nb, R, C) for t in (g.contiguous(), st["z"], st["m"], p))
    v_row, v_col = st["v_row"].view(nb, R), st["v_col"].view(nb, C)
    assert all(t.data_ptr() == src.data_ptr() for t, src in ((z, st["z"]), (m, st["m"]), (bits, p))), "in place: views"
    nrb, ncb = triton.cdiv(R, BLOCK_R), triton.cdiv(C, BLOCK_C)
    grid = (nb, nrb, ncb)
    eta, slope, bc1, bc2, bc2_before = scalars[0], scalars[1], scalars[2], scalars[3], scalars[4]
    dev = g.device

    def per_block(x):  # a per-matrix [n] tensor for each of its factored blocks [n · blocks]
        return x[:, None].expand(n, blocks).reshape(nb)

    row_part = torch.empty(nb, ncb, R, device=dev)
    col_part = torch.empty(nb, nrb, C, device=dev)
    bad_part = torch.empty(nb, nrb, ncb, device=dev, dtype=torch.int32)
    _square_sums[grid](g, row_part, col_part, bad_part, R, C, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
    bad = bad_part.view(n, -1).sum(1)
    w = (bad == 0).float()
    wb = per_block(w)[:, None]
    slope2 = slope * slope
    row2 = torch.where(wb > 0, row_part.sum(1) * slope2 / C, 0.0)  # g²'s row means, straight-through slope in
    col2 = torch.where(wb > 0, col_part.sum(1) * slope2 / R, 0.0)
    clipped = torch.zeros((), dtype=torch.int64, device=dev)
    scale = torch.ones(n, device=dev)
    if grad_clip > 0:
        seen = st["v_row"].flatten(1).mean(1) / bc2_before.clamp_min(1e-30)
        ms = row2.view(n, -1).mean(1)
        scale = torch.where(seen > 0, (grad_clip**2 * seen / ms.clamp_min(1e-30)).sqrt().clamp_max(1.0), 1.0)
        clipped = (scale < 1).sum()
        scale2 = per_block(scale.pow(2))[:, None]
        row2, col2 = row2 * scale2, col2 * scale2
    v_row.mul_(1 - (1 - b2) * wb).add_(row2, alpha=1 - b2)
    v_col.mul_(1 - (1 - b2) * wb).add_(col2, alpha=1 - b2)
    v_mean = v_row.mean(-1).clamp_min(1e-30)
    lerp_w = (1 - b1) * per_block(w)  # 0 where the gradient is not finite, which leaves the moment as it is

    usq_part = torch.empty(nb, nrb, ncb, device=dev)
    _moment_rms[grid](g, m, v_row, v_col, v_mean, slope, per_block(scale), lerp_w, bc1, bc2, usq_part, R, C, eps,
                      BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
    rms = (usq_part.view(n, -1).sum(1) / (blocks * R * C)).sqrt()
    divisor = (rms / update_clip).clamp_min(1.0) if update_clip > 0 else torch.ones_like(rms)

    counts_part = torch.empty(nb, nrb, ncb, 3, device=dev, dtype=torch.int32)
    _latent_update[grid](m, v_row, v_col, v_mean, per_block(divisor), per_block(-eta * w), bc1, bc2, z, bits,
                         counts_part, R, C, eps, hyst, clamp, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
    flips, saturated, clamped = counts_part.sum((0, 1, 2), dtype=torch.int64)
    return torch.stack([flips, saturated, clamped, bad.sum(dtype=torch.int64), clipped]), (rms * w).max().float()


if triton is not None:

    @triton.jit
    def _tile(R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """This program's matrix, its rows and columns, the mask of those inside it and their offsets."""
        mat = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        inside = (rows[:, None] < R) & (cols[None, :] < C)
        offs = (mat.to(tl.int64) * R + rows[:, None]) * C + cols[None, :]
        return mat, rows, cols, inside, offs

    @triton.jit
    def _square_sums(G, ROW_PART, COL_PART, BAD_PART, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        mat, rows, cols, inside, offs = _tile(R, C, BLOCK_R, BLOCK_C)
        g = tl.load(G + offs, mask=inside, other=0.0)
        nonfinite = inside & ((g != g) | (tl.abs(g) == float("inf")))
        g2 = g * g
        rb, cb = tl.program_id(1), tl.program_id(2)
        tl.store(ROW_PART + (mat * tl.num_programs(2) + cb) * R + rows, tl.sum(g2, axis=1), mask=rows < R)
        tl.store(COL_PART + (mat * tl.num_programs(1) + rb) * C + cols, tl.sum(g2, axis=0), mask=cols < C)
        tl.store(BAD_PART + (mat * tl.num_programs(1) + rb) * tl.num_programs(2) + cb,
                 tl.sum(nonfinite.to(tl.int32)))

    @triton.jit
    def _round_to_bf16(x):
        """x rounded to the nearest bf16 value, ties to even, as torch rounds (a float32 with the low 16 bits
        zero). By hand because Triton's CPU interpreter, where the tests run this kernel, truncates instead."""
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _step(m, V_ROW, V_COL, V_MEAN, mat, rows, cols, bc1, bc2, R, C, eps):
        """The normalised step u of the tile's signs from their first moment m (as kept, bf16) and the
        factored second moment (the tensor-op form's order of operations)."""
        v_row = tl.load(V_ROW + mat * R + rows, mask=rows < R, other=0.0)
        v_col = tl.load(V_COL + mat * C + cols, mask=cols < C, other=0.0)
        v = v_row[:, None] * v_col[None, :] / tl.load(V_MEAN + mat)
        return (m / bc1) / (tl.sqrt(v / bc2) + eps)

    @triton.jit
    def _moment_rms(G, M, V_ROW, V_COL, V_MEAN, SLOPE, SCALE, LERP_W, BC1, BC2, USQ_PART, R, C, eps,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        mat, rows, cols, inside, offs = _tile(R, C, BLOCK_R, BLOCK_C)
        lerp_w = tl.load(LERP_W + mat)
        g = tl.load(G + offs, mask=inside, other=0.0)
        g = tl.where(lerp_w != 0.0, g * tl.load(SLOPE), 0.0) * tl.load(SCALE + mat)  # a non-finite g leaves m as it is
        m = tl.load(M + offs, mask=inside, other=0.0).to(tl.float32)
        m = _round_to_bf16(m + lerp_w * (g - m))
        tl.store(M + offs, m.to(tl.bfloat16), mask=inside)  # exact: m is a bf16 value already
        u = _step(m, V_ROW, V_COL, V_MEAN, mat, rows, cols, tl.load(BC1), tl.load(BC2), R, C, eps)
        u = tl.where(inside, u, 0.0)
        tl.store(USQ_PART + (mat * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2),
                 tl.sum(u * u))

    @triton.jit
    def _latent_update(M, V_ROW, V_COL, V_MEAN, DIVISOR, NEG_ETA, BC1, BC2, Z, BITS, COUNTS_PART, R, C, eps, hyst,
                       clamp, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        mat, rows, cols, inside, offs = _tile(R, C, BLOCK_R, BLOCK_C)
        m = tl.load(M + offs, mask=inside, other=0.0).to(tl.float32)
        u = _step(m, V_ROW, V_COL, V_MEAN, mat, rows, cols, tl.load(BC1), tl.load(BC2), R, C, eps)
        step = tl.load(NEG_ETA + mat) * (u / tl.load(DIVISOR + mat))
        z = tl.load(Z + offs, mask=inside, other=0.0)
        bit = tl.load(BITS + offs, mask=inside, other=0.0)
        saturated = inside & (tl.abs(z) >= clamp) & (step * z > 0.0)
        z = z + step
        clamped = inside & (tl.abs(z) > clamp)
        z = tl.minimum(tl.maximum(z, -clamp), clamp)
        new = tl.where(z > hyst, 1.0, tl.where(z < -hyst, -1.0, bit))
        flipped = inside & (new != bit)
        tl.store(Z + offs, z, mask=inside)
        tl.store(BITS + offs, new, mask=inside)
        out = COUNTS_PART + ((mat * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)) * 3
        tl.store(out, tl.sum(flipped.to(tl.int32)))
        tl.store(out + 1, tl.sum(saturated.to(tl.int32)))
        tl.store(out + 2, tl.sum(clamped.to(tl.int32)))
