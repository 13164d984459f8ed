"""The BLR payload (CMF dtype 19): W = Σ_p diag(h_p) · S_U,p · diag(ℓ_p) · S_V,pᵀ · diag(g_p).

Bytes: a 16-byte header (u8 0x4C, u8 1, u8 P, u8 0, u32 r, u32 d_out, u32 d_in), then per path
h f16[d_out] | g f16[d_in] | ℓ f16[r] | U bits [d_out × r/8] | V bits [r × d_in/8], bits LSB-first,
1 → +1. Bits per weight count every stored byte: 8 · payload bytes / (d_out · d_in).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from nvg.errors import NvgError

MAGIC = 0x4C
VERSION = 1
HEADER = struct.Struct("<BBBBIII")


@dataclass(frozen=True)
class BlrHeader:
    paths: int
    rank: int
    d_out: int
    d_in: int


def path_nbytes(rank: int, d_out: int, d_in: int) -> int:
    return 2 * (d_out + d_in + rank) + d_out * rank // 8 + rank * d_in // 8


def payload_nbytes(paths: int, rank: int, d_out: int, d_in: int) -> int:
    return HEADER.size + paths * path_nbytes(rank, d_out, d_in)


def bits_per_weight(paths: int, rank: int, d_out: int, d_in: int) -> float:
    return 8.0 * payload_nbytes(paths, rank, d_out, d_in) / (d_out * d_in)


def path_counts(bpw: float, setting: str, d_out: int, d_in: int) -> tuple[int, ...]:
    """The path counts the encoder tries at `bpw` under config encode.paths `setting` ("1", "2", or "auto": both);
    a budget too small for two paths of rank 8 gets one."""
    if setting == "auto":
        return (1, 2)
    if setting == "2" and max_rank(bpw, 2, d_out, d_in) < 8:
        return (1,)
    return (int(setting),)


def max_rank(bpw: float, paths: int, d_out: int, d_in: int) -> int:
    """The largest multiple of 8 whose payload fits `bpw` bits per weight; 0 when even r = 8 does not."""
    budget_bytes = bpw * d_out * d_in / 8.0
    fixed = HEADER.size + paths * 2 * (d_out + d_in)
    per_rank = paths * (2 + (d_out + d_in) / 8.0)
    r = int((budget_bytes - fixed) // per_rank) // 8 * 8
    while r > 0 and payload_nbytes(paths, r, d_out, d_in) > budget_bytes:
        r -= 8
    return max(0, min(r, (min(d_out, d_in) + 7) // 8 * 8))


def parse_header(raw: bytes, shape: tuple[int, int] | None = None) -> BlrHeader:
    if len(raw) < HEADER.size:
        raise NvgError(f"blr payload is {len(raw)} bytes, shorter than its 16-byte header")
    magic, version, paths, _reserved, rank, d_out, d_in = HEADER.unpack_from(raw, 0)
    if magic != MAGIC:
        raise NvgError(f"blr magic {magic:#x} is not 0x4c")
    if version != VERSION:
        raise NvgError(f"blr version {version} is not 1")
    if paths not in (1, 2):
        raise NvgError(f"blr paths {paths} is not 1 or 2")
    if rank == 0 or rank % 8 or d_in % 8:
        raise NvgError(f"blr rank {rank} and d_in {d_in} must be positive multiples of 8")
    if shape is not None and (d_out, d_in) != tuple(shape):
        raise NvgError(f"blr header shape [{d_out}, {d_in}] does not match the tensor shape {list(shape)}")
    return BlrHeader(paths, rank, d_out, d_in)


def pack_signs(signs: np.ndarray) -> np.ndarray:
    """±1 (or bool, True = +1) [rows, cols] → uint8 [rows, cols/8], LSB-first; sign(0) packs as +1."""
    return np.packbits(np.asarray(signs) >= 0, axis=-1, bitorder="little")


def unpack_signs(bits: np.ndarray, cols: int) -> np.ndarray:
    return np.unpackbits(bits, axis=-1, count=cols, bitorder="little").astype(np.float32) * 2.0 - 1.0


@dataclass
class BlrPath:
    h: np.ndarray  # f32 [d_out]
    g: np.ndarray  # f32 [d_in]
    ell: np.ndarray  # f32 [r]
    u_bits: np.ndarray  # uint8 [d_out, r/8]
    v_bits: np.ndarray  # uint8 [r, d_in/8]

    def signs(self) -> tuple[np.ndarray, np.ndarray]:
        """(S_U [d_out, r], S_V stored as [r, d_in]) as ±1 float32."""
        r = len(self.ell)
        return unpack_signs(self.u_bits, r), unpack_signs(self.v_bits, len(self.g))


@dataclass
class BlrTensor:
    d_out: int
    d_in: int
    rank: int
    paths: list[BlrPath]

    @classmethod
    def from_factors(cls, factors: list[tuple[np.ndarray, ...]]) -> "BlrTensor":
        """From per-path (h, g, ℓ, S_U [d_out, r], S_V [r, d_in]) with ±1 signs."""
        paths = [
            BlrPath(
                np.asarray(h, np.float32), np.asarray(g, np.float32), np.asarray(ell, np.float32),
                pack_signs(su), pack_signs(sv),
            )
            for h, g, ell, su, sv in factors
        ]
        h, g, ell = paths[0].h, paths[0].g, paths[0].ell
        blr = cls(len(h), len(g), len(ell), paths)
        if blr.rank % 8 or blr.d_in % 8:
            raise NvgError(f"blr rank {blr.rank} and d_in {blr.d_in} must be multiples of 8")
        return blr

    @property
    def nbytes(self) -> int:
        return payload_nbytes(len(self.paths), self.rank, self.d_out, self.d_in)

    @property
    def bits_per_weight(self) -> float:
        return bits_per_weight(len(self.paths), self.rank, self.d_out, self.d_in)

    def encode(self) -> bytes:
        out = bytearray(HEADER.pack(MAGIC, VERSION, len(self.paths), 0, self.rank, self.d_out, self.d_in))
        for p in self.paths:
            for v in (p.h, p.g, p.ell):
                out += np.asarray(v, dtype="<f2").tobytes()
            out += np.ascontiguousarray(p.u_bits, dtype=np.uint8).tobytes()
            out += np.ascontiguousarray(p.v_bits, dtype=np.uint8).tobytes()
        return bytes(out)

    def dequantize(self) -> np.ndarray:
        """Dense float32 W [d_out, d_in] (scales rounded to f16 as stored)."""
        w = np.zeros((self.d_out, self.d_in), dtype=np.float32)
        for p in self.paths:
            su, sv = p.signs()
            h, g, ell = (np.asarray(x, np.float16).astype(np.float32) for x in (p.h, p.g, p.ell))
            w += (h[:, None] * su * ell[None, :]) @ (sv * g[None, :])
        return w


def decode(raw: bytes) -> BlrTensor:
    head = parse_header(raw)
    if len(raw) != payload_nbytes(head.paths, head.rank, head.d_out, head.d_in):
        raise NvgError(
            f"blr payload is {len(raw)} bytes but P={head.paths}, r={head.rank}, "
            f"[{head.d_out}, {head.d_in}] needs {payload_nbytes(head.paths, head.rank, head.d_out, head.d_in)}"
        )
    r, d_out, d_in = head.rank, head.d_out, head.d_in
    at = HEADER.size
    paths = []
    for _ in range(head.paths):
        def f16(n):
            nonlocal at
            v = np.frombuffer(raw, dtype="<f2", count=n, offset=at).astype(np.float32)
            at += 2 * n
            return v

        def bits(rows, cols_bytes):
            nonlocal at
            v = np.frombuffer(raw, dtype=np.uint8, count=rows * cols_bytes, offset=at).reshape(rows, cols_bytes).copy()
            at += rows * cols_bytes
            return v

        h, g, ell = f16(d_out), f16(d_in), f16(r)
        paths.append(BlrPath(h, g, ell, bits(d_out, r // 8), bits(r, d_in // 8)))
    return BlrTensor(d_out, d_in, r, paths)
