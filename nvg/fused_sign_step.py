"""The factored optimizer's sign step (`nvg.sign_training.latent_step`) on CUDA in five launches a bucket.

Why: the tensor-op form of one bucket's step is about thirty weight-sized elementwise kernels (the non-finite
mask, the gradient clip's copy, the moment's lerp and bf16 round trip, the factored second moment's outer
product, the update clip, the clamp, the hysteresis), each a full read and write of [n, R, C] floats: on the
H200 the sign step lost 11–13 % of its rate to them since session 14 (docs/benchmarks.md). Here each sign is
read three times and written twice, about 30 bytes in all, and the rank-sized work between the passes runs in
two small kernels of one program a matrix: the step is host-bound on the H200s lent since session 31 (the GPU
busy 41–66 % of it, docs/benchmarks.md), and session 31's form, three passes with ~60 rank-sized tensor ops
between them, took 6 % less GPU time than the tensor ops and was slower by the clock. Five launches, a bucket:

  A `_square_sums`   reads g: per tile, its rows' and columns' sums of g² and its count of non-finite values.
  M `_moments`       a program a matrix: its non-finite count, the gradient clip's scale (from g²'s row means
                     and the second moment's running mean), the factored second moment's row and column means
                     brought up to date, each block's mean of them; the flags and rates the passes need.
  B `_moment_rms`    reads g and m (bf16), writes m: the first moment's update; the partial sums of the
                     step's square, for each matrix's RMS (the update clip needs it before any latent moves).
  D `_update_clip`   a program a matrix: its step's RMS, the update clip's divisor, the largest RMS.
  C `_latent_update` reads m, z and the bits, writes z and the bits; counts flips, saturated and clamped latents.

The arithmetic is the tensor-op form's, in the same order, so the two agree to float rounding (tests in Triton's
CPU interpreter and on the device); partial sums are added in a fixed order and the counts are integers added
atomically, so a step is deterministic. Everything per matrix (η, the slope, the clip scales) stays on the device:
no host synchronisation inside the backward pass.
"""

from __future__ import annotations

import torch

try:  # bundled with CUDA builds of torch; absent from CPU-only installs, which never need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK_R, BLOCK_C = 32, 128  # a tile: 4,096 signs a program, hundreds of programs for SmolLM2's buckets
BLOCK_LINE = 1024  # rows, columns or tile sums a matrix program takes at a time


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
    dev = g.device
    row_part = torch.empty(nb, ncb, R, device=dev)
    col_part = torch.empty(nb, nrb, C, device=dev)
    tile_part = torch.empty(nb, nrb, ncb, device=dev)  # each tile's non-finite count (A → M), then its Σ u² (B → D)
    per_matrix = torch.empty(4, n, device=dev)  # rows: the clip's scale, (1 − b1)·w, −η·w, the update clip's divisor
    v_mean = torch.empty(nb, device=dev)
    counts = torch.zeros(5, dtype=torch.int64, device=dev)  # flips, saturated, clamped, non-finite, clipped
    step_rms = torch.zeros((), device=dev)
    _square_sums[grid](g, row_part, col_part, tile_part, R, C, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
    _moments[(n,)](row_part, col_part, tile_part, v_row, v_col, v_mean, per_matrix, counts, scalars, n, R, C, nrb, ncb,
                   blocks, b1, b2, grad_clip, BLOCK=BLOCK_LINE)
    _moment_rms[grid](g, m, v_row, v_col, v_mean, per_matrix, scalars, tile_part, n, blocks, R, C, eps,
                      BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
    _update_clip[(n,)](tile_part, per_matrix, step_rms, n, blocks * nrb * ncb, blocks * R * C, update_clip,
                       BLOCK=BLOCK_LINE)
    _latent_update[grid](m, v_row, v_col, v_mean, per_matrix, scalars, z, bits, counts, n, blocks, R, C, eps, hyst,
                         clamp, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
    return counts, step_rms


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
        """Per tile: the sums of g² along its rows and its columns, and its count of non-finite values."""
        mat, rows, cols, inside, offs = _tile(R, C, BLOCK_R, BLOCK_C)
        g = tl.load(G + offs, mask=inside, other=0.0)
        nonfinite = inside & ((g != g) | (tl.abs(g) == float("inf")))
        g2 = g * g
        rb, cb = tl.program_id(1), tl.program_id(2)
        tl.store(ROW_PART + (mat * tl.num_programs(2) + cb) * R + rows, tl.sum(g2, axis=1), mask=rows < R)
        tl.store(COL_PART + (mat * tl.num_programs(1) + rb) * C + cols, tl.sum(g2, axis=0), mask=cols < C)
        tl.store(BAD_PART + (mat * tl.num_programs(1) + rb) * tl.num_programs(2) + cb,
                 tl.sum(nonfinite.to(tl.float32)))  # exact: at most BLOCK_R · BLOCK_C

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
    def _line_sum(PART, base, stride, parts, idx, inside):
        """Σ over `parts` partial sums PART[base + k·stride + idx], k = 0 … parts − 1, in that order."""
        total = tl.zeros(idx.shape, tl.float32)
        for k in range(parts):
            total += tl.load(PART + base + k * stride + idx, mask=inside, other=0.0)
        return total

    @triton.jit
    def _decay_means(V, PART, line, parts, length, count, w, slope2, scale2, keep, b2, BLOCK: tl.constexpr):
        """One block's row (or column) means of the second moment, V[line · length …], brought up to date in place:
        g²'s means from the sums of its `parts` tile partials over `count` values each, the straight-through slope²
        and the clip's scale² in (0 for a non-finite matrix, whose means then stay). Returns their new sum."""
        lanes = tl.arange(0, BLOCK)
        total = 0.0
        for s in range(0, length, BLOCK):
            idx = s + lanes
            inside = idx < length
            mean2 = tl.where(w > 0, _line_sum(PART, line * parts * length, length, parts, idx, inside) * slope2 / count, 0.0)
            v = tl.load(V + line * length + idx, mask=inside, other=0.0) * keep + (1 - b2) * (mean2 * scale2)
            tl.store(V + line * length + idx, v, mask=inside)
            total += tl.sum(tl.where(inside, v, 0.0))
        return total

    @triton.jit
    def _moments(ROW_PART, COL_PART, BAD_PART, V_ROW, V_COL, V_MEAN, PER_MATRIX, COUNTS, SCALARS, n, R, C, nrb, ncb,
                 blocks, b1, b2, grad_clip, BLOCK: tl.constexpr):
        """One matrix (its `blocks` factored blocks): whether its gradient is finite (w), the gradient clip's scale,
        the second moment's row and column means updated with the clipped g² means (straight-through slope in),
        each block's mean of the row means; the first moment's rate (1 − b1)·w and −η·w for the passes after."""
        mat = tl.program_id(0)
        lanes = tl.arange(0, BLOCK)
        tiles = blocks * nrb * ncb
        bad = 0.0
        for s in range(0, tiles, BLOCK):
            idx = s + lanes
            bad += tl.sum(tl.load(BAD_PART + mat * tiles + idx, mask=idx < tiles, other=0.0))
        w = tl.where(bad == 0.0, 1.0, 0.0)  # only its zero matters to the step; the count is exact below 2^24 a matrix
        slope = tl.load(SCALARS + 1)
        slope2 = slope * slope
        # the clip compares this step's mean square (g²'s row means, 0 for a non-finite matrix) with the second
        # moment's running mean as it stood before this step
        ms = 0.0
        seen = 0.0
        for b in range(blocks):
            blk = mat * blocks + b
            for s in range(0, R, BLOCK):
                rows = s + lanes
                inside = rows < R
                row_sum = _line_sum(ROW_PART, blk * ncb * R, R, ncb, rows, inside)
                ms += tl.sum(tl.where(inside, row_sum * slope2 / C, 0.0))
                seen += tl.sum(tl.load(V_ROW + blk * R + rows, mask=inside, other=0.0))
        ms = w * ms / (blocks * R)
        seen = seen / (blocks * R) / tl.maximum(tl.load(SCALARS + 4), 1e-30)
        clip = tl.minimum(tl.sqrt(grad_clip * grad_clip * seen / tl.maximum(ms, 1e-30)), 1.0)
        scale = tl.where((grad_clip > 0) & (seen > 0), clip, 1.0)
        scale2 = scale * scale
        keep = 1 - (1 - b2) * w
        for b in range(blocks):
            blk = mat * blocks + b
            total = _decay_means(V_ROW, ROW_PART, blk, ncb, R, C, w, slope2, scale2, keep, b2, BLOCK)
            tl.store(V_MEAN + blk, tl.maximum(total / R, 1e-30))
            _decay_means(V_COL, COL_PART, blk, nrb, C, R, w, slope2, scale2, keep, b2, BLOCK)
        tl.store(PER_MATRIX + 0 * n + mat, scale)
        tl.store(PER_MATRIX + 1 * n + mat, (1 - b1) * w)  # LERP_W: 0 leaves a non-finite matrix's moment as it is
        tl.store(PER_MATRIX + 2 * n + mat, -tl.load(SCALARS) * w)  # η is SCALARS[0]
        tl.atomic_add(COUNTS + 3, bad.to(tl.int64))
        tl.atomic_add(COUNTS + 4, (scale < 1).to(tl.int64))

    @triton.jit
    def _update_clip(USQ_PART, PER_MATRIX, STEP_RMS, n, tiles, size, update_clip, BLOCK: tl.constexpr):
        """One matrix: its step's RMS from its tiles' Σ u², the update clip's divisor, the largest RMS (of the
        matrices that move) into STEP_RMS."""
        mat = tl.program_id(0)
        lanes = tl.arange(0, BLOCK)
        total = 0.0
        for s in range(0, tiles, BLOCK):
            idx = s + lanes
            total += tl.sum(tl.load(USQ_PART + mat * tiles + idx, mask=idx < tiles, other=0.0))
        rms = tl.sqrt(total / size)
        divisor = tl.where(update_clip > 0, tl.maximum(rms / tl.maximum(update_clip, 1e-30), 1.0), 1.0)
        tl.store(PER_MATRIX + 3 * n + mat, divisor)
        w = tl.where(tl.load(PER_MATRIX + 1 * n + mat) != 0.0, 1.0, 0.0)
        tl.atomic_max(STEP_RMS, rms * w)  # ≥ 0, so the zero it starts from is the identity

    @triton.jit
    def _moment_rms(G, M, V_ROW, V_COL, V_MEAN, PER_MATRIX, SCALARS, USQ_PART, n, blocks, R, C, eps,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """Per tile: the first moment's update (bf16, in place) and the partial Σ u² of the step it gives."""
        blk, rows, cols, inside, offs = _tile(R, C, BLOCK_R, BLOCK_C)
        mat = blk // blocks
        lerp_w = tl.load(PER_MATRIX + 1 * n + mat)
        g = tl.load(G + offs, mask=inside, other=0.0)
        # a non-finite matrix's g leaves its moment as it is; the clip's scale is PER_MATRIX's first row
        g = tl.where(lerp_w != 0.0, g * tl.load(SCALARS + 1), 0.0) * tl.load(PER_MATRIX + mat)
        m = tl.load(M + offs, mask=inside, other=0.0).to(tl.float32)
        m = _round_to_bf16(m + lerp_w * (g - m))
        tl.store(M + offs, m.to(tl.bfloat16), mask=inside)  # exact: m is a bf16 value already
        u = _step(m, V_ROW, V_COL, V_MEAN, blk, rows, cols, tl.load(SCALARS + 2), tl.load(SCALARS + 3), R, C, eps)
        u = tl.where(inside, u, 0.0)
        tl.store(USQ_PART + (blk * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2),
                 tl.sum(u * u))

    @triton.jit
    def _latent_update(M, V_ROW, V_COL, V_MEAN, PER_MATRIX, SCALARS, Z, BITS, COUNTS, n, blocks, R, C, eps, hyst,
                       clamp, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """Per tile: the latents moved by the clipped step, the bits across the hysteresis band; the counts."""
        blk, rows, cols, inside, offs = _tile(R, C, BLOCK_R, BLOCK_C)
        mat = blk // blocks
        m = tl.load(M + offs, mask=inside, other=0.0).to(tl.float32)
        u = _step(m, V_ROW, V_COL, V_MEAN, blk, rows, cols, tl.load(SCALARS + 2), tl.load(SCALARS + 3), R, C, eps)
        step = tl.load(PER_MATRIX + 2 * n + mat) * (u / tl.load(PER_MATRIX + 3 * n + mat))
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
        tl.atomic_add(COUNTS + 0, tl.sum(flipped.to(tl.int32)).to(tl.int64))
        tl.atomic_add(COUNTS + 1, tl.sum(saturated.to(tl.int32)).to(tl.int64))
        tl.atomic_add(COUNTS + 2, tl.sum(clamped.to(tl.int32)).to(tl.int64))
