"""hash64: cortiq's non-cryptographic 64-bit hash of a byte string (reference/cortiq.md §1.7).

Vectorised over little-endian u64 words with numpy, so hashing a 100 MB blob takes well under a second."""

import numpy as np

_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _fmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(33))
        x = x * _M1
        x = x ^ (x >> np.uint64(33))
        x = x * _M2
        return x ^ (x >> np.uint64(33))


def hash64(data: bytes | bytearray | memoryview) -> int:
    data = memoryview(data).cast("B")
    n = len(data)
    pad = (-n) % 8
    buf = np.frombuffer(bytes(data) + b"\0" * pad if pad else data, dtype="<u8")
    with np.errstate(over="ignore"):
        idx = np.arange(len(buf), dtype=np.uint64) * _GOLDEN
        acc = np.bitwise_xor.reduce(_fmix64(buf.astype(np.uint64)) ^ idx) if len(buf) else np.uint64(0)
    acc = np.uint64(acc) ^ np.uint64(n)
    return int(_fmix64(np.array([acc], dtype=np.uint64))[0])


def hex16(value: int) -> str:
    """A hash as cortiq writes it in `section_hashes`: 16 lower-case hex digits."""
    return f"{value:016x}"
