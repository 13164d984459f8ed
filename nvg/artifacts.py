"""The pipeline's HDF5 artifacts, read and written in one place (beside `cmf.py` and `blr.py`).

* `windows.h5` — `tokens` int32 [N, window]; attributes n_train, n_eval, window, seed, sources,
  tokenizer_hash, tokens_blake2b. The last n_eval rows are held out.
* `topk.{shard}.h5` — `ids` int32 [n, window, k], `logp` float16 [n, window, k] (log-probs over the
  full vocabulary), `rows` (which windows); attributes k, teacher_hash, windows_hash.
* `grams/{model}.h5` — `layer{i}/{input}/fit` and `…/sel` float32 [n, n] with count_fit/count_sel;
  attributes model, model_hash, windows_hash, inputs.

Every writer goes through `atomic_path`: a killed job leaves no file under the output's name. Every
reader checks what it reads before a stage trains on it: the windows against their content hash, a
top-k shard against the windows and the teacher it was made from, Grams against their model, a student
against the teacher it was encoded from, and ranges and finiteness of every value."""

from __future__ import annotations

import contextlib
import hashlib
import math
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


def write_windows(out, tokens: np.ndarray, origin: np.ndarray, attrs: dict) -> None:
    """`tokens` [N, window] int32 and `origin` [N] (each window's index in `attrs["sources"]`), each with its
    content hash among the attributes."""
    with atomic_path(out) as tmp:
        with h5py.File(tmp, "w") as f:
            f.create_dataset("tokens", data=tokens, chunks=(1, tokens.shape[1]))
            f.create_dataset("origin", data=origin)
            f.attrs.update({**attrs, "tokens_blake2b": content_hash(tokens), "origin_blake2b": content_hash(origin)})


def read_window_origins(path, n_windows: int, n_sources: int) -> np.ndarray:
    """Each window's source (an index into the windows' `sources` attribute), checked against its content
    hash, its length and the number of sources."""
    try:
        with h5py.File(path, "r") as f:
            origin, digest = f["origin"][...], f.attrs.get("origin_blake2b")
    except (OSError, KeyError) as e:
        raise NvgError(f"{path}: no readable origin dataset ({e}; written by an older nvg: rerun tokenize_windows)") from None
    if content_hash(origin) != digest:
        raise NvgError(f"{path}: origin does not match its origin_blake2b (the file changed after tokenize_windows wrote it)")
    if origin.shape != (n_windows,) or (origin.size and (origin.min() < 0 or origin.max() >= n_sources)):
        raise NvgError(f"{path}: origin must give each of the {n_windows} windows one of its {n_sources} sources")
    return origin


# ── topk.{shard}.h5 ─────────────────────────────────────────────────────────────────────────────────


def shard_rows(n: int, shard: int, shards: int) -> np.ndarray:
    """Shard s of S takes the s-th contiguous block of all windows (train and held-out)."""
    return np.array_split(np.arange(n), shards)[shard]


def model_hash(cmf) -> str:
    """Identifies a model's content (the teacher's, or a student's): the directory hash covers every
    tensor's hash."""
    with open(cmf.path, "rb") as f:  # the envelope alone, not the whole file again
        return hex16(int.from_bytes(f.read(128)[0x78:0x80], "little"))


def encoded_from(student) -> str | None:
    """The `teacher_hash` the encoder recorded in a student (None: no nvg_encode record, cortiq's own)."""
    return student.header.get("provenance", {}).get("nvg_encode", {}).get("teacher_hash")


def check_encoded_from(student, teacher) -> None:
    """A student must have been encoded from this teacher (one without a record passes on its shape alone)
    and have its vocabulary, width and depth."""
    recorded = encoded_from(student)
    if recorded is not None and recorded != model_hash(teacher):
        raise NvgError(f"{student.path}: encoded from teacher {recorded}, not from {teacher.path} ({model_hash(teacher)})")
    for key in ("vocab_size", "hidden_size", "num_layers"):
        if teacher.arch.get(key) != student.arch.get(key):
            raise NvgError(f"{teacher.path}: arch.{key} {teacher.arch.get(key)} differs from the student's {student.arch.get(key)}")


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


class TopkReader:
    """The teacher's top-k of any window rows, read from the shard files when asked: memory holds one
    batch, not 6·k bytes per token of the whole run (38 GB at 100M tokens). Every shard must come from
    these `windows` (their attributes) and one teacher, with one k, ids in [0, vocab) and finite
    log-probs ≤ 0: checked on opening, streaming through the shards `CHECK_BYTES` at a time."""

    CHECK_BYTES = 64 << 20

    def __init__(self, paths: list[Path], windows: dict, n_windows: int, vocab: int):
        self.files, self.shard_of, self.local = [], np.full(n_windows, -1), np.zeros(n_windows, dtype=np.int64)
        first: dict = {}
        for i, p in enumerate(paths):
            try:
                f = h5py.File(p, "r")
                self.files.append(f)
                attrs = dict(f.attrs)
                if attrs.get("windows_hash") != windows["tokens_blake2b"]:
                    raise NvgError(f"{p}: made from other windows (windows_hash {attrs.get('windows_hash')} is not "
                                   f"{windows['tokens_blake2b']}): rerun teacher_topk")
                first = first or {"k": int(attrs["k"]), "teacher_hash": str(attrs["teacher_hash"]), "path": p}
                for key in ("k", "teacher_hash"):
                    if (int(attrs[key]) if key == "k" else attrs[key]) != first[key]:
                        raise NvgError(f"{p}: {key} {attrs[key]} differs from {first['path']}'s {first[key]}")
                rows = f["rows"][...]
                if rows.size and (rows.min() < 0 or rows.max() >= n_windows):
                    raise NvgError(f"{p}: rows outside the {n_windows} windows")
                self.shard_of[rows], self.local[rows] = i, np.arange(len(rows))
                step = max(1, self.CHECK_BYTES // (6 * math.prod(f["ids"].shape[1:])))  # int32 ids + float16 logp
                for s in range(0, len(rows), step):
                    self._check(p, f["ids"][s : s + step], f["logp"][s : s + step], vocab)
            except (OSError, KeyError) as e:
                self.close()
                raise NvgError(f"{p}: not a readable top-k shard ({e})") from None
            except NvgError:
                self.close()
                raise
        if (self.shard_of < 0).any():
            self.close()
            raise NvgError(f"{paths[0]}: the top-k shards cover {(self.shard_of >= 0).sum()} of {n_windows} windows")
        self.k, self.teacher_hash, self.path = first["k"], first["teacher_hash"], first["path"]

    def check_teacher(self, expected: str | None, whose: str) -> None:
        """The shards must hold the predictions of the teacher whose hash is `expected` (None: unknown,
        nothing to check); `whose` says where that hash comes from ("<file> was encoded from teacher")."""
        if expected is not None and self.teacher_hash != expected:
            self.close()
            raise NvgError(f"{self.path}: top-k of teacher {self.teacher_hash}, but {whose} {expected}")

    @staticmethod
    def _check(path, ids: np.ndarray, logp: np.ndarray, vocab: int) -> None:
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise NvgError(f"{path}: ids outside the vocabulary [0, {vocab})")
        if not np.isfinite(logp).all() or (logp > 1e-3).any():
            raise NvgError(f"{path}: logp holds NaN, infinite or positive values (log-probabilities are finite and <= 0)")

    def read(self, rows) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32 [len(rows), window, k], logp float16 [...]) in the order of `rows`. A run of
        consecutive rows within one shard (a training batch) is one contiguous read."""
        rows = np.asarray(rows, dtype=np.int64)
        parts = []
        for shard in np.unique(self.shard_of[rows]):
            mine = rows[self.shard_of[rows] == shard]
            local = self.local[mine]
            f = self.files[shard]
            if len(local) and (np.diff(local) == 1).all():
                parts.append((mine, f["ids"][local[0] : local[-1] + 1], f["logp"][local[0] : local[-1] + 1]))
            else:  # h5py reads increasing indices; put them back in the asked order
                order = np.argsort(local)
                inverse = np.argsort(order)
                parts.append((mine, f["ids"][local[order]][inverse], f["logp"][local[order]][inverse]))
        if len(parts) == 1:
            return parts[0][1], parts[0][2]
        position = {int(r): j for j, r in enumerate(rows)}
        ids = np.empty((len(rows), *parts[0][1].shape[1:]), dtype=np.int32)
        logp = np.empty((len(rows), *parts[0][2].shape[1:]), dtype=np.float16)
        for mine, part_ids, part_logp in parts:
            at = [position[int(r)] for r in mine]
            ids[at], logp[at] = part_ids, part_logp
        return ids, logp

    def close(self) -> None:
        for f in self.files:
            f.close()
        self.files = []


def read_topk(paths: list[Path], windows: dict, n_windows: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Every window's top-k in memory, (ids [N, window, k], logp [N, window, k]): for small runs and
    tests; the stages read rows on demand through `TopkReader`."""
    reader = TopkReader(paths, windows, n_windows, vocab)
    try:
        return reader.read(np.arange(n_windows))
    finally:
        reader.close()


# ── grams/{model}.h5 ────────────────────────────────────────────────────────────────────────────────


HEAD_INPUT = (None, "head_in")  # the Gram key of the LM head's input: one per model, not per layer


def _gram_group(layer: int | None, name: str) -> str:
    return name if layer is None else f"layer{layer}/{name}"


def write_grams(out, fit: dict, sel: dict, count_fit: int, count_sel: int, attrs: dict) -> None:
    """`fit`/`sel`: {(layer, input name): H float32 [n, n]}, the head's input under `HEAD_INPUT`."""
    with atomic_path(out) as tmp:
        with h5py.File(tmp, "w") as f:
            for (layer, name), h in fit.items():
                grp = f.create_group(_gram_group(layer, name))
                grp.create_dataset("fit", data=h)
                grp.create_dataset("sel", data=sel[(layer, name)])
                grp.attrs.update({"count_fit": count_fit, "count_sel": count_sel})
            f.attrs.update(attrs)


def check_grams(path, *models) -> None:
    """The Grams must have been captured from one of `models` (their `model_hash`): the teacher, or the
    student being re-encoded."""
    try:
        with h5py.File(path, "r") as f:
            made_from = str(f.attrs["model_hash"])
    except (OSError, KeyError) as e:
        raise NvgError(f"{path}: not a readable Gram file ({e}); rerun gram_capture") from None
    if made_from not in {model_hash(m) for m in models}:
        named = " or ".join(f"{m.path} ({model_hash(m)})" for m in models)
        raise NvgError(f"{path}: Grams of model {made_from}, not of {named}")


def read_grams(path, layer: int | None, name: str) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(H_fit, H_sel, count_fit, count_sel) of one layer input (layer None: the head's, `HEAD_INPUT`)."""
    try:
        with h5py.File(path, "r") as f:
            g = f[_gram_group(layer, name)]
            return g["fit"][...], g["sel"][...], int(g.attrs["count_fit"]), int(g.attrs["count_sel"])
    except (OSError, KeyError) as e:
        raise NvgError(f"{path}: Gram {_gram_group(layer, name)} not readable ({e}); rerun gram_capture") from None


# ── corpus/generated.{shard}.h5 ─────────────────────────────────────────────────────────────────────


def write_corpus(out, tokens: np.ndarray, attrs: dict) -> None:
    """`tokens` int32 [n, length]: sequences the teacher wrote; attributes teacher_hash, shard, settings."""
    with atomic_path(out) as tmp:
        with h5py.File(tmp, "w") as f:
            f.create_dataset("tokens", data=tokens, chunks=(1, tokens.shape[1]))
            f.attrs.update(attrs)


def read_corpus_shard(path, teacher: str) -> tuple[np.ndarray, int]:
    """One generated shard's sequences and its shard index, checked: written for the teacher whose
    `teacher_hash` is given, and holding the tokens its digest names."""
    try:
        with h5py.File(path, "r") as f:
            tokens = f["tokens"][...]
            made_by, shard, digest = f.attrs["teacher_hash"], int(f.attrs["shard"]), f.attrs["tokens_blake2b"]
    except (OSError, KeyError) as e:
        raise NvgError(f"{path}: not a readable generated corpus shard ({e})") from None
    if made_by != teacher:
        raise NvgError(f"{path}: teacher_hash {made_by} is not this teacher's {teacher} (a corpus from another teacher)")
    if content_hash(tokens) != digest:
        raise NvgError(f"{path}: tokens_blake2b {digest} does not match its tokens (a damaged or edited shard)")
    return tokens, shard


def read_corpus(paths: list[Path], teacher: str) -> np.ndarray:
    """Every shard's sequences, in shard order: int32 [N, length]; each shard checked (`read_corpus_shard`)
    and the shard its place says (a shard copied in from elsewhere, or damaged, is not trained on)."""
    parts = []
    for i, p in enumerate(paths):
        tokens, shard = read_corpus_shard(p, teacher)
        if shard != i:
            raise NvgError(f"{p}: shard {shard} given as shard {i} (the shards out of order, or one twice)")
        parts.append(tokens)
    if len({part.shape[1] for part in parts}) > 1:
        raise NvgError(f"{paths[0]}: the generated shards have different sequence lengths")
    return np.concatenate(parts)
