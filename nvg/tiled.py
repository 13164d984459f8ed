"""cortiq's row-laddered tile formats q4tp (dtype 15) and q2tp (dtype 16): groups of 32 consecutive values
of a row, 4 or 2 bits each, and one 5-bit scale code per group that picks a rung of its row's geometric
scale ladder. Layout (cortiq-core `quant.rs` at 0.5.100, `q4tp_sections` / `q2tp_sections`):

    [weight plane: rows · cols/32 groups × 16 (q4tp) or 8 (q2tp) bytes]
    [row params: rows × (f16 lo, f16 step)]
    [scale codes: rows × ceil(5 · cols/32 / 8) bytes, 5-bit fields LSB-first, each row byte-aligned]

Ladder of row r: q4tp s(c) = 2^(lo + c·step), c = 0..31; q2tp s(0) = 0 (a group that is exactly zero) and
s(c) = 2^(lo + (c−1)·step), c = 1..31, computed as one exp2 and then repeated f32 multiplies, as cortiq does.
Values: q4tp nibble n → (n − 8)·s, low nibble first; q2tp 2-bit field c → (c − 1.5)·s, LSB-first in a byte.

At 576 columns q2tp costs 2.21 bits per weight and q4tp 4.21 (q4_block: 4.5); the per-row ladder spends 5
bits on a group's scale where q4_block spends an f16. Here a tensor is seen as integer codes [groups, 32]
and float scales [groups] with w = code · scale — q2tp's codes are doubled (2c − 3 ∈ {−3, −1, 1, 3}, scale
s/2) so that they stay integers — which is the view `GroupScaled` trains.
"""

from __future__ import annotations

import numpy as np

GROUP = 32
PLANE_BYTES = {4: 16, 2: 8}  # weight-plane bytes per group
RUNGS = 32


def code_stride(groups_per_row: int) -> int:
    return -(-groups_per_row * 5 // 8)


def nbytes(bits: int, rows: int, cols: int) -> int:
    gpr = cols // GROUP
    return rows * gpr * PLANE_BYTES[bits] + rows * 4 + rows * code_stride(gpr)


def ladders(lo: np.ndarray, step: np.ndarray, bits: int) -> np.ndarray:
    """[rows, 32] float32 rung scales from f16 (lo, step), in cortiq's order of f32 operations."""
    lo32, st32 = lo.astype(np.float32), step.astype(np.float32)
    t = np.empty((len(lo32), RUNGS), dtype=np.float32)
    t[:, 0] = np.exp2(lo32)
    ratio = np.exp2(st32)
    for c in range(1, RUNGS):
        t[:, c] = t[:, c - 1] * ratio
    if bits == 2:  # rung 0 is the exact zero; the geometric part moves up one
        t = np.concatenate([np.zeros((len(t), 1), np.float32), t[:, :-1]], axis=1)
    return t


def _unpack_codes(buf: bytes, rows: int, gpr: int) -> np.ndarray:
    stride = code_stride(gpr)
    raw = np.frombuffer(buf, dtype=np.uint8).reshape(rows, stride)
    bits = np.unpackbits(raw, axis=1, bitorder="little")[:, : gpr * 5].reshape(rows, gpr, 5)
    return (bits.astype(np.int64) << np.arange(5)).sum(2)


def _pack_codes(rungs: np.ndarray) -> bytes:
    rows, gpr = rungs.shape
    bits = ((rungs[:, :, None] >> np.arange(5)) & 1).astype(np.uint8).reshape(rows, gpr * 5)
    bits = np.pad(bits, ((0, 0), (0, code_stride(gpr) * 8 - gpr * 5)))
    return np.packbits(bits, axis=1, bitorder="little").tobytes()


def _unpack_plane(buf: bytes, groups: int, bits: int) -> np.ndarray:
    raw = np.frombuffer(buf, dtype=np.uint8, count=groups * PLANE_BYTES[bits]).reshape(groups, -1)
    per_byte = 8 // bits
    fields = (raw[:, :, None] >> (bits * np.arange(per_byte, dtype=np.uint8))) & ((1 << bits) - 1)
    return fields.reshape(groups, GROUP)


def _pack_plane(fields: np.ndarray, bits: int) -> bytes:
    per_byte = 8 // bits
    f = fields.astype(np.uint8).reshape(len(fields), -1, per_byte)
    return (f << (bits * np.arange(per_byte, dtype=np.uint8))).sum(2).astype(np.uint8).tobytes()


def _sections(buf: bytes, bits: int, rows: int, cols: int):
    gpr = cols // GROUP
    plane = rows * gpr * PLANE_BYTES[bits]
    params = np.frombuffer(buf, dtype="<f2", count=2 * rows, offset=plane).reshape(rows, 2)
    return buf[:plane], params, buf[plane + 4 * rows :]


def groups(buf: bytes, bits: int, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Integer codes int8 [rows·cols/32, 32] and float32 scales [rows·cols/32]: w = code · scale."""
    gpr = cols // GROUP
    plane, params, codes = _sections(buf, bits, rows, cols)
    scale = np.take_along_axis(ladders(params[:, 0], params[:, 1], bits), _unpack_codes(codes, rows, gpr), 1).reshape(-1)
    fields = _unpack_plane(plane, rows * gpr, bits).astype(np.int8)
    if bits == 4:
        return fields - 8, scale
    return 2 * fields - 3, scale / 2


def _fit_ladder(scales: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row (lo, step) as f16 whose ladder spans that row's positive scales [rows, groups]."""
    pos = scales > 0
    logs = np.log2(np.where(pos, scales, 1.0))
    lo = np.where(pos.any(1), np.where(pos, logs, np.inf).min(1), 0.0)
    hi = np.where(pos.any(1), np.where(pos, logs, -np.inf).max(1), 0.0)
    span = RUNGS - 1 - (bits == 2)  # geometric rungs above the lowest
    lo16 = lo.astype(np.float16)
    step16 = np.maximum((hi - lo16.astype(np.float64)) / span, 0.0).astype(np.float16)
    return lo16, step16


def _nearest_rungs(target: np.ndarray, ladder: np.ndarray, bits: int) -> np.ndarray:
    """Per group the rung of its row's ladder nearest in log2 to the target scale (q2tp: 0 for a zero group)."""
    first = 1 if bits == 2 else 0
    geo = np.log2(np.maximum(ladder[:, first:], 1e-38))
    t = np.log2(np.maximum(target, 1e-38))
    rung = np.abs(t[:, :, None] - geo[:, None, :]).argmin(2) + first
    return np.where(target > 0, rung, 0) if bits == 2 else rung


def _round_fields(w: np.ndarray, s: np.ndarray, bits: int) -> np.ndarray:
    safe = np.where(s > 0, s, 1.0)[..., None]
    if bits == 4:
        return np.clip(np.rint(w / safe) + 8, 0, 15)
    return np.clip(np.floor(w / safe + 2.0), 0, 3)  # nearest of ±0.5, ±1.5


def _values(fields: np.ndarray, s: np.ndarray, bits: int) -> np.ndarray:
    return (fields - (8.0 if bits == 4 else 1.5)) * s[..., None]


def encode(w: np.ndarray, bits: int) -> bytes:
    """The q4tp / q2tp payload of a [rows, cols] matrix, cols a multiple of 32. Each group's scale is its
    absmax over the top level (a least-squares scale clips the few large entries, which session 10 measured
    to cost the teacher more perplexity though the squared error was lower), the row's ladder spans those
    scales, and each group takes the rung, of its nearest and their neighbours, whose values err least."""
    rows, cols = w.shape
    g = np.asarray(w, dtype=np.float32).reshape(rows, cols // GROUP, GROUP)
    return _assemble(g, np.abs(g).max(2) / (7.0 if bits == 4 else 1.5), bits)


def with_codes(buf: bytes, bits: int, rows: int, cols: int, codes: np.ndarray) -> bytes:
    """The payload with new integer codes (the `groups` view's: q2tp's doubled) and its scales kept."""
    c = np.asarray(codes, dtype=np.int64).reshape(rows * (cols // GROUP), GROUP)
    fields = c + 8 if bits == 4 else (c + 3) // 2
    return _pack_plane(fields, bits) + buf[rows * (cols // GROUP) * PLANE_BYTES[bits]:]


def _assemble(g: np.ndarray, target: np.ndarray, bits: int, fields: np.ndarray | None = None) -> bytes:
    """Payload for groups g [rows, gpr, 32] at target scales [rows, gpr]: the ladder, then for each group the
    best of its nearest rungs (re-rounding the values unless `fields` are given and kept)."""
    lo, step = _fit_ladder(target, bits)
    ladder = ladders(lo, step, bits)
    near = _nearest_rungs(target, ladder, bits)
    best_r, best_e, best_f = near, np.full(near.shape, np.inf, np.float32), None
    for d in (-1, 0, 1):
        r = np.clip(near + d, 1 if bits == 2 else 0, RUNGS - 1)
        r = np.where(target > 0, r, near) if bits == 2 else r
        s = np.take_along_axis(ladder, r, 1)
        f = fields if fields is not None else _round_fields(g, s, bits)
        e = ((g - _values(f, s, bits)) ** 2).sum(2)
        better = e < best_e
        best_r, best_e = np.where(better, r, best_r), np.where(better, e, best_e)
        best_f = f if best_f is None else np.where(better[..., None], f, best_f)
    rows, gpr = target.shape
    params = np.stack([lo, step], axis=1).astype("<f2").tobytes()
    return _pack_plane(best_f.reshape(rows * gpr, GROUP), bits) + params + _pack_codes(best_r)


def with_scales(buf: bytes, bits: int, rows: int, cols: int, scales: np.ndarray) -> bytes:
    """The payload with its weight plane kept and new group scales (the `groups` view's, e.g. trained):
    each row's ladder refitted to them and every group's rung chosen again."""
    gpr = cols // GROUP
    codes, _ = groups(buf, bits, rows, cols)
    fields = (codes + 8 if bits == 4 else (codes + 3) // 2).reshape(rows, gpr, GROUP)
    s = np.asarray(scales, dtype=np.float64).reshape(rows, gpr) * (1 if bits == 4 else 2)
    target = np.maximum(s, 0.0)  # a scale trained through zero is a group that no longer matters
    g = _values(fields, target, bits)  # what the trained scales mean, as values
    return _assemble(g.astype(np.float32), target, bits, fields)
