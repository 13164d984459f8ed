"""The pipeline's HDF5 artifacts, read and written in one place (beside `cmf.py` and `blr.py`).

* `windows.h5` — `tokens` int32 [N, window]; attributes n_train, n_eval, window, seed, sources,
  tokenizer_hash, tokens_hash. The last n_eval rows are held out.
* `topk.{shard}.h5` — `ids` int32 [n, window, k], `logp` float16 [n, window, k] (log-probs over the
  full vocabulary), `rows` (which windows); attributes k, teacher_hash, windows_hash.
* `grams/{model}.h5` — `layer{i}/{input}/fit` and `…/sel` float32 [n, n] with count_fit/count_sel;
  attributes model, windows_hash, inputs.

Every writer goes through `atomic_path`: a killed job leaves no file under the output's name."""

from __future__ import annotations

import contextlib
from pathlib import Path

import h5py
import numpy as np

from nvg.atomic import atomic_path
from nvg.errors import NvgError
from nvg.hash64 import hex16

# ── windows.h5 ──────────────────────────────────────────────────────────────────────────────────────


def read_windows(path) -> tuple[np.ndarray, dict]:
    """(tokens [N, window] int32, attributes) of a windows.h5."""
    try:
        with h5py.File(path, "r") as f:
            return f["tokens"][...], dict(f.attrs)
    except (OSError, KeyError) as e:
        raise NvgError(f"{path}: not a readable windows.h5 ({e})") from None


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
    with atomic_path(out) as tmp:
        with h5py.File(tmp, "w") as f:
            writer = TopkShardWriter(f, len(rows), window, k)
            f.create_dataset("rows", data=rows)
            f.attrs.update(attrs)
            yield writer
        with h5py.File(tmp, "r") as f:
            if f["ids"].shape != (len(rows), window, k) or not np.isfinite(f["logp"][-1]).all():
                raise NvgError(f"{out}: verification of the written shard failed")


def read_topk(paths: list[Path], n_windows: int) -> tuple[np.ndarray, np.ndarray]:
    """Gather every shard into (ids [N, window, k], logp [N, window, k]) indexed by window row."""
    ids = logp = None
    seen = np.zeros(n_windows, dtype=bool)
    for p in paths:
        try:
            with h5py.File(p, "r") as f:
                rows = f["rows"][...]
                if ids is None:
                    k, window = f.attrs["k"], f["ids"].shape[1]
                    ids = np.zeros((n_windows, window, k), dtype=np.int32)
                    logp = np.zeros((n_windows, window, k), dtype=np.float16)
                ids[rows], logp[rows] = f["ids"][...], f["logp"][...]
                seen[rows] = True
        except (OSError, KeyError) as e:
            raise NvgError(f"{p}: not a readable top-k shard ({e})") from None
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
