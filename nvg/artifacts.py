"""The pipeline's HDF5 artifacts, read and written in one place (beside `cmf.py` and `blr.py`).

* `windows.h5` — `tokens` int32 [N, window]; attributes n_train, n_eval, window, seed, sources,
  tokenizer_hash, tokens_blake2b. The last n_eval rows are held out.
* `topk.{shard}.h5` — `ids` int32 [n, window, k], `logp` float16 [n, window, k] (log-probs over the
  full vocabulary), `rows` (which windows); attributes k, teacher_hash, windows_hash.
* `grams/{model}.h5` — `layer{i}/{input}/fit` and `…/sel` float32 [n, n] with count_fit/count_sel;
  attributes model, windows_hash, inputs.

Every writer goes through `atomic_path`: a killed job leaves no file under the output's name. Every
reader checks what it reads before a stage trains on it: the windows against their content hash, a
top-k shard against the windows it was made from, and ranges and finiteness of every value."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

import h5py
import numpy as np

from nvg.atomic import atomic_path
from nvg.errors import NvgError
from nvg.hash64 import hex16

# ── windows.h5 ──────────────────────────────────────────────────────────────────────────────────────


def content_hash(a: np.ndarray) -> str:
    """BLAKE2b-128 of an array's dtype, shape and bytes. Unlike cortiq's hash64 it sees the order of
    rows, so swapped or replaced windows change it."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{a.dtype.str}{a.shape}".encode())
    h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def read_windows(path, vocab: int | None = None) -> tuple[np.ndarray, dict]:
    """(tokens [N, window] int32, attributes) of a windows.h5, checked against its content hash and,
    given the model's `vocab`, every id in [0, vocab)."""
    try:
        with h5py.File(path, "r") as f:
            tokens, attrs = f["tokens"][...], dict(f.attrs)
    except (OSError, KeyError) as e:
        raise NvgError(f"{path}: not a readable windows.h5 ({e})") from None
    if "tokens_blake2b" not in attrs:
        raise NvgError(f"{path}: no tokens_blake2b attribute (written by an older nvg: rerun tokenize_windows)")
    if content_hash(tokens) != attrs["tokens_blake2b"]:
        raise NvgError(f"{path}: tokens do not match their tokens_blake2b (the file changed after tokenize_windows wrote it)")
    if vocab is not None and tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        bad = int(tokens.min()) if tokens.min() < 0 else int(tokens.max())
        raise NvgError(f"{path}: token id {bad} is outside the model's vocabulary [0, {vocab})")
    return tokens, attrs


def write_windows(out, tokens: np.ndarray, attrs: dict) -> None:
    with atomic_path(out) as tmp:
        with h5py.File(tmp, "w") as f:
            f.create_dataset("tokens", data=tokens, chunks=(1, tokens.shape[1]))
            f.attrs.update(attrs)


# ── topk.{shard}.h5 ─────────────────────────────────────────────────────────────────────────────────


def shard_rows(n: int, shard: int, shards: int) -> np.ndarray:
    """Shard s of S takes the s-th contiguous block of all windows (train and held-out)."""
    return np.array_split(np.arange(n), shards)[shard]


def teacher_hash(cmf) -> str:
    """Identifies the teacher's content: the directory hash covers every tensor's hash."""
    with open(cmf.path, "rb") as f:  # the envelope alone, not the whole file again
        return hex16(int.from_bytes(f.read(128)[0x78:0x80], "little"))


class TopkShardWriter:
    """Fills one shard's datasets batch by batch; `topk_shard` verifies them before the rename."""

    def __init__(self, f: h5py.File, n: int, window: int, k: int):
        self.ids = f.create_dataset("ids", (n, window, k), dtype=np.int32, chunks=(1, window, k))
        self.logp = f.create_dataset("logp", (n, window, k), dtype=np.float16, chunks=(1, window, k))

    def write(self, start: int, ids: np.ndarray, logp: np.ndarray) -> None:
        self.ids[start : start + len(ids)] = ids
        self.logp[start : start + len(ids)] = logp


@contextlib.contextmanager
def topk_shard(out, rows: np.ndarray, window: int, k: int, attrs: dict):
    """Yield a `TopkShardWriter` for `rows`; on success check shapes and finiteness, then rename."""
    with atomic_path(out, len(rows) * window * k * 6) as tmp:  # int32 ids + float16 log-probs
        with h5py.File(tmp, "w") as f:
            writer = TopkShardWriter(f, len(rows), window, k)
            f.create_dataset("rows", data=rows)
            f.attrs.update(attrs)
            yield writer
        with h5py.File(tmp, "r") as f:
            if f["ids"].shape != (len(rows), window, k) or not np.isfinite(f["logp"][-1]).all():
                raise NvgError(f"{out}: verification of the written shard failed")


def read_topk(paths: list[Path], windows: dict, n_windows: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Gather every shard into (ids [N, window, k], logp [N, window, k]) indexed by window row. Every
    shard must come from these `windows` (their attributes) and one teacher, with one k, ids in
    [0, vocab) and finite log-probs ≤ 0."""
    ids = logp = None
    first: dict = {}
    seen = np.zeros(n_windows, dtype=bool)
    for p in paths:
        try:
            with h5py.File(p, "r") as f:
                attrs = dict(f.attrs)
                if attrs.get("windows_hash") != windows["tokens_blake2b"]:
                    raise NvgError(f"{p}: made from other windows (windows_hash {attrs.get('windows_hash')} is not "
                                   f"{windows['tokens_blake2b']}): rerun teacher_topk")
                first = first or {"k": int(attrs["k"]), "teacher_hash": attrs["teacher_hash"], "path": p}
                for key in ("k", "teacher_hash"):
                    if (int(attrs[key]) if key == "k" else attrs[key]) != first[key]:
                        raise NvgError(f"{p}: {key} {attrs[key]} differs from {first['path']}'s {first[key]}")
                rows, shard_ids, shard_logp = f["rows"][...], f["ids"][...], f["logp"][...]
        except (OSError, KeyError) as e:
            raise NvgError(f"{p}: not a readable top-k shard ({e})") from None
        if rows.size and (rows.min() < 0 or rows.max() >= n_windows):
            raise NvgError(f"{p}: rows outside the {n_windows} windows")
        if shard_ids.size and (shard_ids.min() < 0 or shard_ids.max() >= vocab):
            raise NvgError(f"{p}: ids outside the vocabulary [0, {vocab})")
        if not np.isfinite(shard_logp).all() or (shard_logp > 1e-3).any():
            raise NvgError(f"{p}: logp holds NaN, infinite or positive values (log-probabilities are finite and <= 0)")
        if ids is None:
            window, k = shard_ids.shape[1], first["k"]
            ids = np.zeros((n_windows, window, k), dtype=np.int32)
            logp = np.zeros((n_windows, window, k), dtype=np.float16)
        ids[rows], logp[rows] = shard_ids, shard_logp
        seen[rows] = True
    if not seen.all():
        raise NvgError(f"{paths[0]}: the top-k shards cover {seen.sum()} of {n_windows} windows")
    return ids, logp


# ── grams/{model}.h5 ────────────────────────────────────────────────────────────────────────────────


def write_grams(out, fit: dict, sel: dict, count_fit: int, count_sel: int, attrs: dict) -> None:
    """`fit`/`sel`: {(layer, input name): H float32 [n, n]}."""
    with atomic_path(out) as tmp:
        with h5py.File(tmp, "w") as f:
            for (layer, name), h in fit.items():
                grp = f.create_group(f"layer{layer}/{name}")
                grp.create_dataset("fit", data=h)
                grp.create_dataset("sel", data=sel[(layer, name)])
                grp.attrs.update({"count_fit": count_fit, "count_sel": count_sel})
            f.attrs.update(attrs)


def read_grams(path, layer: int, name: str) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(H_fit, H_sel, count_fit, count_sel) of one layer input."""
    try:
        with h5py.File(path, "r") as f:
            g = f[f"layer{layer}/{name}"]
            return g["fit"][...], g["sel"][...], int(g.attrs["count_fit"]), int(g.attrs["count_sel"])
    except (OSError, KeyError) as e:
        raise NvgError(f"{path}: Gram layer{layer}/{name} not readable ({e})") from None


# ── corpus/generated.{shard}.h5 ─────────────────────────────────────────────────────────────────────


def write_corpus(out, tokens: np.ndarray, attrs: dict) -> None:
    """`tokens` int32 [n, length]: sequences the teacher wrote; attributes teacher_hash, shard, settings."""
    with atomic_path(out) as tmp:
        with h5py.File(tmp, "w") as f:
            f.create_dataset("tokens", data=tokens, chunks=(1, tokens.shape[1]))
            f.attrs.update(attrs)


def read_corpus(paths: list[Path], teacher: str) -> np.ndarray:
    """Every shard's sequences, in shard order: int32 [N, length]; each shard must come from the
    teacher whose `teacher_hash` is given."""
    parts = []
    for p in paths:
        try:
            with h5py.File(p, "r") as f:
                parts.append(f["tokens"][...])
                made_by = f.attrs["teacher_hash"]
        except (OSError, KeyError) as e:
            raise NvgError(f"{p}: not a readable generated corpus shard ({e})") from None
        if made_by != teacher:
            raise NvgError(f"{p}: teacher_hash {made_by} is not this teacher's {teacher} (a corpus from another teacher)")
    if len({part.shape[1] for part in parts}) > 1:
        raise NvgError(f"{paths[0]}: the generated shards have different sequence lengths")
    return np.concatenate(parts)
