"""CMF v2: read and write cortiq's model container, byte-compatible (reference/cortiq.md §1).

Layout of a fresh write: 128-byte envelope | header JSON | tensor directory | zero pad to 4096 |
data blob (tensors at 64, payloads >= 16 KiB at 4096) | vocab (tokenizer.json bytes).
Every structural check of cortiq.md §1.10 is a hard `NvgError` naming the file, the field and the
offset; hashes are checked by `verify`, not on open (as cortiq does).

Beside cortiq's hash64 (kept for compatibility; it is blind to the order of 8-byte words, so two
swapped rows pass it), every file nvg writes records BLAKE2b-128 digests of each tensor's payload, of
the directory and of the vocab section under the header key `nvg_blake2b`; `verify` checks both.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nvg import tiled
from nvg.atomic import atomic_path
from nvg.errors import NvgError
from nvg.hash64 import hash64, hex16

MAGIC = b"CMF\x01"
VERSION = 2
ENVELOPE = struct.Struct("<4sIII12QQQ")  # magic, version, flags, features, 6 (off, len), 2 hashes
RECORD = struct.Struct("<IHBB6IQQQ")  # name_off, name_len, dtype, ndim, shape[6], off, nbytes, hash
DATA_ALIGN = 4096
TENSOR_ALIGN = 64
BIG_PAYLOAD = 16 * 1024

FEATURE_TENSOR_DIR = 1 << 0
FEATURE_BINARY_MASKS = 1 << 1
FEATURE_QUANT_2F = 1 << 2
FEATURE_LOOP_MASKS = 1 << 5
FEATURE_SKILL_FILE = 1 << 6
KNOWN_FEATURES = FEATURE_TENSOR_DIR | FEATURE_BINARY_MASKS | FEATURE_QUANT_2F | FEATURE_LOOP_MASKS | FEATURE_SKILL_FILE

DTYPE_NAMES = {
    0: "f32", 1: "f16", 2: "bf16", 3: "q8_row", 4: "q4_block", 5: "mix8_4", 6: "u8", 7: "q4_col",
    8: "vbit", 9: "q8_2f", 10: "vbit_ro", 11: "q4_tiled", 12: "q1", 13: "q1s", 14: "q1t", 15: "q4tp",
    16: "q2tp", 19: "blr",
}
DTYPE_IDS = {name: i for i, name in DTYPE_NAMES.items()}
F32, F16, BF16, Q8_ROW, Q4_BLOCK, Q8_2F, Q4TP, Q2TP, BLR = 0, 1, 2, 3, 4, 9, 15, 16, 19
TILED_BITS = {Q4TP: 4, Q2TP: 2}  # nvg/tiled.py
GROUP_SCALED = (Q8_ROW, Q4_BLOCK, Q4TP, Q2TP)  # dtypes that are integer codes × one scale per group

# cortiq's ModelArch keys with serde defaults (cortiq.md §1.3): written explicitly so any reader agrees.
ARCH_REQUIRED = (
    "arch_name", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads", "num_kv_heads",
    "head_dim", "vocab_size", "layer_types", "rms_norm_eps", "max_position_embeddings",
)
ARCH_DEFAULTS = {
    "norm_style": "qwen", "rope_theta": 10000.0, "tie_word_embeddings": False, "partial_rotary_factor": 1.0,
    "hidden_act": "silu", "embed_multiplier": 1.0, "num_loops": 1, "loop_final_norm": False, "attn_v_norm": False,
}

SHARD_NAME = re.compile(r"^(?P<base>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.cmf$")


@dataclass
class Tensor:
    """One directory entry and its payload bytes (a view into the file)."""

    name: str
    dtype: int
    shape: tuple[int, ...]
    data: bytes | memoryview
    stored_hash: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class CmfFile:
    path: Path
    header: dict
    tensors: dict[str, Tensor] = field(default_factory=dict)
    vocab: bytes | None = None
    features: int = FEATURE_TENSOR_DIR

    @property
    def arch(self) -> dict:
        return {**ARCH_DEFAULTS, **self.header["arch"]}


def _fail(path, field_name: str, offset: int | None, problem: str):
    where = f" at offset {offset:#x}" if offset is not None else ""
    raise NvgError(f"{path}: {field_name}{where}: {problem}")


def expected_nbytes(path, t: Tensor, record_offset: int) -> int | None:
    """The payload size a fixed-size dtype must have (cortiq's `expected_nbytes`); None for variable ones."""
    n = t.numel
    if t.dtype == F32:
        return 4 * n
    if t.dtype in (F16, BF16):
        return 2 * n
    if t.dtype == 6:
        return n
    if t.dtype == Q8_ROW:
        return n + 2 * (t.shape[0] if len(t.shape) > 1 else 1)
    if t.dtype in (Q4_BLOCK, 11):
        return 18 * -(-n // 32)
    if t.dtype == 12:
        return 6 * -(-n // 32)
    if t.dtype == Q8_2F:
        return n + 2 * t.shape[0] + 2 * t.shape[-1]
    if t.dtype in TILED_BITS:
        if len(t.shape) != 2 or t.shape[1] % 32:
            _fail(path, f"tensor {t.name!r} shape", record_offset + 8, f"{list(t.shape)}: {DTYPE_NAMES[t.dtype]} needs [rows, cols] with cols a multiple of 32")
        return tiled.nbytes(TILED_BITS[t.dtype], *t.shape)
    if t.dtype == BLR:
        from nvg import blr

        try:
            head = blr.parse_header(bytes(t.data[: blr.HEADER.size]), (t.shape[0], t.shape[-1]))
        except NvgError as e:
            _fail(path, f"tensor {t.name!r} blr header", record_offset, str(e))
        return blr.payload_nbytes(head.paths, head.rank, head.d_out, head.d_in)
    return None


def read_cmf(path: str | os.PathLike) -> CmfFile:
    """Open a CMF v2 file (or the first shard of a sharded one, merging its siblings)."""
    path = Path(path)
    m = SHARD_NAME.match(path.name)
    if m:
        no, count = int(m["no"]), int(m["count"])
        if no != 1:
            _fail(path, "shard", None, f"shard {no} of {count} opened; open the first shard")
        first = _read_one(path)
        for k in range(2, count + 1):
            sib = path.with_name(f"{m['base']}-{k:05d}-of-{count:05d}.cmf")
            if not sib.exists():
                _fail(sib, "shard", None, f"missing sibling shard {k} of {count}")
            part = _read_one(sib)
            sh = part.header.get("shard", {})
            if sh.get("no") != k or sh.get("count") != count:
                _fail(sib, "header.shard", None, f"says {sh}, expected no {k} of count {count}")
            for name, t in part.tensors.items():
                if name in first.tensors:
                    _fail(sib, f"tensor {name!r}", None, "duplicate tensor name across shards")
                first.tensors[name] = t
        return first
    return _read_one(path)


def _read_one(path: Path) -> CmfFile:
    return _load(path)[0]


def _load(path: Path) -> tuple[CmfFile, memoryview]:
    """One file parsed, and its bytes (which the tensors' payloads view), from a single read. The bytes
    are a read-only memory map: pages come from the page cache as they are touched and can be dropped
    again, so an 8B teacher's 16 GB are not held in the process besides the model built from them (nvg
    replaces files by renaming, never rewrites one in place, so a mapped file does not change under us)."""
    try:
        with open(path, "rb") as fh:
            raw = memoryview(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)) if os.fstat(fh.fileno()).st_size else memoryview(b"")
    except (OSError, ValueError) as e:
        raise NvgError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    size = len(raw)
    if size < ENVELOPE.size:
        _fail(path, "envelope", 0, f"file is {size} bytes, shorter than the 128-byte envelope")
    magic, version, _flags, features, *rest = ENVELOPE.unpack_from(raw, 0)
    if magic != MAGIC:
        _fail(path, "magic", 0, f"{bytes(magic)!r} is not b'CMF\\x01'")
    if version != VERSION:
        _fail(path, "version", 4, f"{version} is not 2")
    if features & ~KNOWN_FEATURES:
        _fail(path, "required_features", 12, f"unknown feature bits {features & ~KNOWN_FEATURES:#x}")
    sections = {}
    for i, name in enumerate(("header", "dir", "data", "masks", "vocab", "index")):
        off, length = rest[2 * i], rest[2 * i + 1]
        if off + length > size or off + length < off:
            _fail(path, f"{name}_off/{name}_len", 0x10 + 16 * i, f"section [{off}, {off + length}) runs past the end of the {size}-byte file")
        sections[name] = (off, length)
    for name in ("header", "dir"):
        if sections[name][1] == 0:
            _fail(path, f"{name}_len", 0x10 + 16 * ("header", "dir").index(name), "is 0")
    data_off, data_len = sections["data"]
    if data_len and data_off % DATA_ALIGN:
        _fail(path, "data_off", 0x30, f"{data_off} is not a multiple of 4096")
    h_off, h_len = sections["header"]
    try:
        header = json.loads(bytes(raw[h_off : h_off + h_len]).decode("utf-8"))
        if not isinstance(header, dict) or not isinstance(header.get("arch"), dict):
            raise ValueError("no 'arch' object")
    except (ValueError, UnicodeDecodeError) as e:
        _fail(path, "header JSON", h_off, f"not a valid CMF header: {e}")
    missing = [k for k in ARCH_REQUIRED if k not in header["arch"]]
    if missing:
        _fail(path, "header.arch", h_off, f"missing required keys {missing}")
    d_off, d_len = sections["dir"]
    tensors = _parse_directory(path, raw[d_off : d_off + d_len], d_off, raw[data_off : data_off + data_len], data_off)
    v_off, v_len = sections["vocab"]
    vocab = bytes(raw[v_off : v_off + v_len]) if v_len else None
    return CmfFile(path=path, header=header, tensors=tensors, vocab=vocab, features=features), raw


def _parse_directory(path, dir_bytes, d_off, blob, data_off) -> dict[str, Tensor]:
    if len(dir_bytes) < 16:
        _fail(path, "directory", d_off, f"{len(dir_bytes)} bytes, shorter than its 16-byte head")
    count, pool_off = struct.unpack_from("<QQ", dir_bytes, 0)
    if 16 + RECORD.size * count > len(dir_bytes) or pool_off > len(dir_bytes):
        _fail(path, "directory", d_off, f"{count} records do not fit in {len(dir_bytes)} bytes")
    tensors: dict[str, Tensor] = {}
    for i in range(count):
        rec_at = 16 + RECORD.size * i
        name_off, name_len, dtype, ndim, *rest = RECORD.unpack_from(dir_bytes, rec_at)
        shape6, (off, nbytes, thash) = rest[:6], rest[6:]
        abs_rec = d_off + rec_at
        start = pool_off + name_off
        if start + name_len > len(dir_bytes):
            _fail(path, f"directory record {i} name", abs_rec, "name runs past the name pool")
        try:
            name = bytes(dir_bytes[start : start + name_len]).decode("utf-8")
        except UnicodeDecodeError:
            _fail(path, f"directory record {i} name", abs_rec, "name is not UTF-8")
        if ndim > 6:
            _fail(path, f"tensor {name!r} ndim", abs_rec + 7, f"{ndim} > 6")
        if dtype not in DTYPE_NAMES:
            _fail(path, f"tensor {name!r} dtype", abs_rec + 6, f"unknown dtype id {dtype}")
        if off % TENSOR_ALIGN:
            _fail(path, f"tensor {name!r} off", abs_rec + 32, f"{off} is not a multiple of 64")
        if off + nbytes > len(blob):
            _fail(path, f"tensor {name!r} off+nbytes", abs_rec + 32, f"[{off}, {off + nbytes}) runs past the {len(blob)}-byte data blob")
        if name in tensors:
            _fail(path, f"tensor {name!r}", abs_rec, "duplicate tensor name")
        t = Tensor(name, dtype, tuple(shape6[:ndim]), blob[off : off + nbytes], thash)
        want = expected_nbytes(path, t, abs_rec)
        if want is not None and want != nbytes:
            _fail(path, f"tensor {name!r} nbytes", abs_rec + 40, f"{nbytes} but {DTYPE_NAMES[dtype]} {list(t.shape)} needs {want}")
        tensors[name] = t
    return tensors


def encode_directory(entries: list[tuple[Tensor, int]]) -> bytes:
    """Directory bytes for (tensor, offset-in-blob) pairs; the name pool follows the records."""
    pool = bytearray()
    recs = bytearray()
    for t, off in entries:
        name = t.name.encode("utf-8")
        shape = list(t.shape) + [0] * (6 - len(t.shape))
        recs += RECORD.pack(len(pool), len(name), t.dtype, len(t.shape), *shape, off, len(t.data), hash64(t.data))
        pool += name
    return struct.pack("<QQ", len(entries), 16 + len(recs)) + bytes(recs) + bytes(pool)


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


def cmf_bytes(header: dict, tensors: list[Tensor], vocab: bytes | None = None) -> bytes:
    """The whole file as bytes; deterministic (same content gives the same bytes)."""
    header = dict(header)
    header.pop("section_hashes", None)
    if vocab:
        header["section_hashes"] = {"vocab": hex16(hash64(vocab))}
    blob = bytearray()
    entries = []
    for t in tensors:
        cursor = _align(len(blob), DATA_ALIGN if len(t.data) >= BIG_PAYLOAD else TENSOR_ALIGN)
        blob += b"\0" * (cursor - len(blob))
        entries.append((t, cursor))
        blob += bytes(t.data)
    directory = encode_directory(entries)
    header["nvg_blake2b"] = {"directory": blake2b(directory), "vocab": blake2b(vocab) if vocab else None,
                             "tensors": {t.name: blake2b(t.data) for t in tensors}}
    header_bytes = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    features = FEATURE_TENSOR_DIR
    if any(t.dtype in (8, Q8_2F) for t in tensors):
        features |= FEATURE_QUANT_2F
    h_off = ENVELOPE.size
    d_off = h_off + len(header_bytes)
    data_off = _align(d_off + len(directory), DATA_ALIGN)
    v_off = data_off + len(blob) if vocab else 0
    envelope = ENVELOPE.pack(
        MAGIC, VERSION, 0, features,
        h_off, len(header_bytes), d_off, len(directory), data_off, len(blob),
        0, 0, v_off, len(vocab or b""), 0, 0,
        hash64(header_bytes), hash64(directory),
    )
    pad = b"\0" * (data_off - d_off - len(directory))
    return envelope + header_bytes + directory + pad + bytes(blob) + (vocab or b"")


def write_cmf(path, header: dict, tensors: list[Tensor], vocab: bytes | None = None) -> None:
    raw = cmf_bytes(header, tensors, vocab)
    with atomic_path(path, len(raw)) as tmp:
        tmp.write_bytes(raw)


def write_cmf_shards(first_path, header: dict, tensors: list[Tensor], vocab: bytes | None, count: int) -> list[Path]:
    """Split tensors in order into `count` complete files `{base}-NNNNN-of-NNNNN.cmf`; vocab in shard 1 only."""
    m = SHARD_NAME.match(Path(first_path).name)
    if not m:
        raise NvgError(f"{first_path}: shard path must end in -00001-of-{count:05d}.cmf")
    per = -(-len(tensors) // count)
    paths = []
    for k in range(count):
        p = Path(first_path).with_name(f"{m['base']}-{k + 1:05d}-of-{count:05d}.cmf")
        h = {**header, "shard": {"no": k + 1, "count": count}}
        if k:
            h.pop("tokenizer_config", None)
        write_cmf(p, h, tensors[k * per : (k + 1) * per], vocab if k == 0 else None)
        paths.append(p)
    return paths


def blake2b(data) -> str:
    """The strong digest nvg records beside hash64: BLAKE2b-128, hex."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _verify_strong(f: Path, one: CmfFile, raw: bytes, d_off: int, d_len: int, v_off: int, v_len: int) -> list[str]:
    """The `nvg_blake2b` digests, when the file has them (cortiq's own files do not)."""
    strong = one.header.get("nvg_blake2b")
    if strong is None:
        return []
    problems = []
    if strong.get("directory") != blake2b(raw[d_off : d_off + d_len]):
        problems.append(f"{f}: nvg_blake2b.directory does not match the directory bytes")
    if strong.get("vocab") != (blake2b(raw[v_off : v_off + v_len]) if v_len else None):
        problems.append(f"{f}: nvg_blake2b.vocab does not match the vocab section")
    want = strong.get("tensors", {})
    if set(want) != set(one.tensors):
        problems.append(f"{f}: nvg_blake2b.tensors names {len(want)} tensors, the directory {len(one.tensors)}")
    for t in one.tensors.values():
        if t.name in want and blake2b(t.data) != want[t.name]:
            problems.append(f"{f}: tensor {t.name!r} BLAKE2b does not match its payload")
    return problems


def _verify_one(f: Path, one: CmfFile, raw: memoryview) -> list[str]:
    """The hashes of one file (one shard): hash64 of header, directory, vocab and each tensor, then BLAKE2b."""
    problems = []
    _, _, _, _, *rest = ENVELOPE.unpack_from(raw, 0)
    (h_off, h_len, d_off, d_len), (header_hash, dir_hash) = rest[:4], rest[12:]
    v_off, v_len = rest[8], rest[9]
    if header_hash and hash64(raw[h_off : h_off + h_len]) != header_hash:
        problems.append(f"{f}: header_hash at offset 0x70 does not match the header bytes")
    if dir_hash and hash64(raw[d_off : d_off + d_len]) != dir_hash:
        problems.append(f"{f}: dir_hash at offset 0x78 does not match the directory bytes")
    want_vocab = one.header.get("section_hashes", {}).get("vocab")
    if v_len and want_vocab and hex16(hash64(raw[v_off : v_off + v_len])) != want_vocab:
        problems.append(f"{f}: section_hashes.vocab does not match the vocab section")
    for t in one.tensors.values():
        if hash64(t.data) != t.stored_hash:
            problems.append(f"{f}: tensor {t.name!r} hash does not match its payload")
    return problems + _verify_strong(f, one, raw, d_off, d_len, v_off, v_len)


def verify(path) -> list[str]:
    """Every hash in the file, or in every shard of a sharded one (header, directory, each tensor, each
    section; hash64 and BLAKE2b); returns the mismatches."""
    path = Path(path)
    files = [path]
    m = SHARD_NAME.match(path.name)
    if m:
        files = [path.with_name(f"{m['base']}-{k:05d}-of-{m['count']}.cmf") for k in range(1, int(m["count"]) + 1)]
    problems = []
    for f in files:
        problems += _verify_one(f, *_load(f))
    return problems


def read_verified(path) -> CmfFile:
    """`read_cmf` after `verify`: a stage never trains on, encodes from or copies a file whose bytes
    changed after they were hashed (export would otherwise write fresh hashes over the damage). A
    single file is read and parsed once for both."""
    path = Path(path)
    if SHARD_NAME.match(path.name):
        cmf, problems = read_cmf(path), verify(path)
    else:
        cmf, raw = _load(path)
        problems = _verify_one(path, cmf, raw)
    if problems:
        raise NvgError(f"{problems[0]} (the file changed after it was written: rerun the stage that wrote it)")
    return cmf


# ── dequantisation (teachers may arrive quantised) ──

def _f16(b, count, at=0) -> np.ndarray:
    return np.frombuffer(b, dtype="<f2", count=count, offset=at).astype(np.float32)


def tensor_to_numpy(t: Tensor) -> np.ndarray:
    """A dense float32 copy of any readable dtype (blr is dequantised through its codec)."""
    n, shape = t.numel, t.shape
    buf = bytes(t.data)
    if t.dtype == F32:
        return np.frombuffer(buf, dtype="<f4").reshape(shape).copy()
    if t.dtype == F16:
        return _f16(buf, n).reshape(shape)
    if t.dtype == BF16:
        u = np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16
        return u.view(np.float32).reshape(shape)
    if t.dtype in GROUP_SCALED:
        codes, scale = quant_groups(t)
        return (codes.astype(np.float32) * scale[:, None]).reshape(-1)[:n].reshape(shape)
    if t.dtype == Q8_2F:
        q = np.frombuffer(buf, dtype=np.int8, count=n).astype(np.float32).reshape(shape[0], -1)
        row = _f16(buf, shape[0], n)
        col = _f16(buf, shape[-1], n + 2 * shape[0])
        return (q * row[:, None] * col[None, :]).reshape(shape)
    if t.dtype == BLR:
        from nvg import blr

        return blr.decode(buf).dequantize().reshape(shape)
    raise NvgError(f"tensor {t.name!r}: dtype {DTYPE_NAMES[t.dtype]} cannot be read as weights")


def _code_bytes(t: Tensor) -> int:
    return t.numel if t.dtype == Q8_ROW else -(-t.numel // 32) * 16



def quant_groups(t: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """A q8_row, q4_block, q4tp or q2tp tensor as its integer codes, int8 [groups, group size], and its scales
    as float32 [groups]: w = code · scale of its group. A q8_row group is a row; a q4_block group is 32
    consecutive values of the flattened tensor (the last one zero-padded), its code the nibble − 8; q4tp
    and q2tp groups are 32 values of a row, their scales rungs of the row's ladder (nvg/tiled.py)."""
    buf = bytes(t.data)
    if t.dtype in TILED_BITS:
        return tiled.groups(buf, TILED_BITS[t.dtype], *t.shape)
    if t.dtype == Q8_ROW:
        rows = t.shape[0] if len(t.shape) > 1 else 1
        return np.frombuffer(buf, dtype=np.int8, count=t.numel).reshape(rows, -1).copy(), _f16(buf, rows, t.numel)
    if t.dtype == Q4_BLOCK:
        groups = -(-t.numel // 32)
        nib = np.frombuffer(buf, dtype=np.uint8, count=groups * 16)
        codes = np.stack([nib & 0x0F, nib >> 4], axis=1).reshape(groups, 32).astype(np.int8) - 8
        return codes, _f16(buf, groups, groups * 16)
    raise ValueError(f"quant_groups: tensor {t.name!r} is {DTYPE_NAMES[t.dtype]}, not one of {GROUP_SCALED}")


def with_group_scales(t: Tensor, scales: np.ndarray) -> bytes:
    """`t`'s payload with its codes kept and new scales: rounded to f16 (q8_row, q4_block), or onto refitted
    row ladders (q4tp, q2tp)."""
    if t.dtype in TILED_BITS:
        return tiled.with_scales(bytes(t.data), TILED_BITS[t.dtype], *t.shape, scales)
    if t.dtype not in (Q8_ROW, Q4_BLOCK):
        raise ValueError(f"with_group_scales: tensor {t.name!r} is {DTYPE_NAMES[t.dtype]}, not one of {GROUP_SCALED}")
    return bytes(t.data)[: _code_bytes(t)] + np.asarray(scales, dtype=np.float32).astype("<f2").tobytes()


CODE_RANGE = {Q8_ROW: (-127, 127, 1), Q4_BLOCK: (-8, 7, 1), Q4TP: (-8, 7, 1), Q2TP: (-3, 3, 2)}  # lo, hi, spacing


def with_group_codes(t: Tensor, codes: np.ndarray) -> bytes:
    """`t`'s payload with new integer codes ([groups, group size], as `quant_groups` gives them) and its
    scales kept."""
    if t.dtype in TILED_BITS:
        return tiled.with_codes(bytes(t.data), TILED_BITS[t.dtype], *t.shape, codes)
    c = np.asarray(codes, dtype=np.int64).reshape(-1)
    if t.dtype == Q8_ROW:
        return c.astype(np.int8).tobytes() + bytes(t.data)[t.numel:]
    if t.dtype == Q4_BLOCK:
        q = (c + 8).astype(np.uint8).reshape(-1, 32)
        return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8).tobytes() + bytes(t.data)[_code_bytes(t):]
    raise ValueError(f"with_group_codes: tensor {t.name!r} is {DTYPE_NAMES[t.dtype]}, not one of {GROUP_SCALED}")


def dense_tensor(name: str, array: np.ndarray, dtype: int = F16) -> Tensor:
    """A Tensor from a float array: f32/f16/bf16 (f16: IEEE round-to-nearest-even), cortiq's q8_row
    (int8 per row, scale absmax/127) and q4_block (groups of 32, scale absmax/7), rounded to nearest as
    cortiq's converter does (reference/cortiq.md §1.5), or q4tp / q2tp (absmax scales on row ladders, `tiled.encode`)."""
    a = np.ascontiguousarray(array, dtype=np.float32)
    if dtype == F32:
        payload = a.astype("<f4").tobytes()
    elif dtype == F16:
        payload = a.astype("<f2").tobytes()
    elif dtype == BF16:
        u = a.view(np.uint32).astype(np.uint64)
        rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")  # round to nearest even
        payload = rounded.tobytes()
    elif dtype == Q8_ROW:
        rows = a.reshape(a.shape[0] if a.ndim > 1 else 1, -1)
        scale = (np.abs(rows).max(1) / 127).astype("<f2")
        safe = np.where(scale == 0, 1, scale).astype(np.float32)[:, None]
        payload = np.clip(np.rint(rows / safe), -127, 127).astype(np.int8).tobytes() + scale.tobytes()
    elif dtype == Q4_BLOCK:
        flat = a.reshape(-1)
        groups = np.pad(flat, (0, -len(flat) % 32)).reshape(-1, 32)
        scale = (np.abs(groups).max(1) / 7).astype("<f2")
        safe = np.where(scale == 0, 1, scale).astype(np.float32)[:, None]
        q = (np.clip(np.rint(groups / safe), -8, 7) + 8).astype(np.uint8)
        payload = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8).tobytes() + scale.tobytes()
    elif dtype in TILED_BITS:
        if a.ndim != 2 or a.shape[1] % 32:
            raise ValueError(f"dense_tensor: {name!r} {list(a.shape)}: {DTYPE_NAMES[dtype]} needs [rows, cols] with cols a multiple of 32")
        payload = tiled.encode(a, TILED_BITS[dtype])
    else:
        raise ValueError(f"dense_tensor: dtype {dtype} is not f32/f16/bf16/q8_row/q4_block/q4tp/q2tp")
    return Tensor(name, dtype, tuple(a.shape), payload)
