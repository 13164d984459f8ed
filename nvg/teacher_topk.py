"""Stage `teacher_topk`: the teacher's top-k next-token log-probs for one shard of the windows.

Output `topk.{shard}.h5`: `ids` int32 [n, window, k], `logp` float16 [n, window, k] (log-probs over the
full vocabulary, so the tail mass 1 − Σ exp(logp) is known), `rows` (which windows); attributes k,
teacher_hash, windows_hash. Shard s of S takes the s-th contiguous block of all windows (train and
held-out), so a crash loses one shard and a cluster runs shards in parallel.

    python -m nvg.teacher_topk --teacher T.cmf --windows W.h5 --shard 0 --out topk.0.h5 --settings JSON
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch

from nvg.atomic import atomic_path
from nvg.cmf import read_cmf
from nvg.errors import NvgError, exits_cleanly
from nvg.hash64 import hex16
from nvg.losses import topk_logprobs
from nvg.model import autocast, compile_blocks, load_model, pick_device
from nvg.settings import check, from_json
from nvg.tokenize_windows import read_windows


@dataclass
class TopkSettings:
    k: int = 64
    shards: int = 2
    batch: int = 8
    device: str = "auto"
    precision: str = "bf16"

    def __post_init__(self):
        check(1 <= self.k <= 1024, "teacher_topk", "k", f"must be in [1, 1024], got {self.k}")
        check(self.shards >= 1, "teacher_topk", "shards", f"must be >= 1, got {self.shards}")
        check(self.batch >= 1, "teacher_topk", "batch", f"must be >= 1, got {self.batch}")
        check(self.precision in ("bf16", "fp16", "fp32"), "teacher_topk", "precision", f"bf16, fp16 or fp32, got {self.precision!r}")


def shard_rows(n: int, shard: int, shards: int) -> np.ndarray:
    return np.array_split(np.arange(n), shards)[shard]


def teacher_hash(cmf) -> str:
    """Identifies the teacher's content: the directory hash covers every tensor's hash."""
    with open(cmf.path, "rb") as f:  # the envelope alone, not the whole file again
        return hex16(int.from_bytes(f.read(128)[0x78:0x80], "little"))


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


def main(teacher: Path, windows: Path, shard: int, out: Path, settings: TopkSettings) -> None:
    tokens, attrs = read_windows(windows)
    rows = shard_rows(len(tokens), shard, settings.shards)
    device = pick_device(settings.device)
    cmf = read_cmf(teacher)
    model = load_model(cmf, device)
    if settings.precision != "fp32" and device.type == "cuda":
        model = model.to(torch.bfloat16 if settings.precision == "bf16" else torch.float16)
    model = compile_blocks(model)
    window, k = tokens.shape[1], settings.k
    t0, done = time.perf_counter(), 0
    with atomic_path(out) as tmp:
        with h5py.File(tmp, "w") as f:
            d_ids = f.create_dataset("ids", (len(rows), window, k), dtype=np.int32, chunks=(1, window, k))
            d_logp = f.create_dataset("logp", (len(rows), window, k), dtype=np.float16, chunks=(1, window, k))
            f.create_dataset("rows", data=rows)
            f.attrs.update({"k": k, "teacher_hash": teacher_hash(cmf), "windows_hash": attrs["tokens_hash"]})
            for s in range(0, len(rows), settings.batch):
                ids = torch.from_numpy(tokens[rows[s : s + settings.batch]]).to(device, non_blocking=True)
                with torch.no_grad(), autocast(device, settings.precision):
                    top_ids, top_logp = topk_logprobs(model.hidden(ids), model.head_weight, k)
                d_ids[s : s + len(ids)] = top_ids.cpu().numpy()
                d_logp[s : s + len(ids)] = top_logp.half().cpu().numpy()
                done += ids.numel()
                print(f"\rteacher_topk shard {shard}: {s + len(ids)}/{len(rows)} windows, "
                      f"{done / (time.perf_counter() - t0):.0f} tok/s", end="", file=sys.stderr)
        with h5py.File(tmp, "r") as f:  # verify before the rename: shapes and finiteness
            if f["ids"].shape != (len(rows), window, k) or not np.isfinite(f["logp"][-1]).all():
                raise NvgError(f"{out}: verification of the written shard failed")
    print(f"\nteacher_topk: shard {shard}/{settings.shards}: {len(rows)} windows, {done} tokens, "
          f"{done / (time.perf_counter() - t0):.0f} tok/s on {device} → {out}", file=sys.stderr)


@exits_cleanly
def cli(argv=None):
    ap = argparse.ArgumentParser(prog="nvg teacher-topk", description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", required=True, type=Path)
    ap.add_argument("--windows", required=True, type=Path)
    ap.add_argument("--shard", required=True, type=int)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--settings", required=True)
    a = ap.parse_args(argv)
    s = from_json(TopkSettings, a.settings, "teacher_topk")
    if not 0 <= a.shard < s.shards:
        raise NvgError(f"--shard {a.shard}: must be in [0, {s.shards})")
    main(a.teacher, a.windows, a.shard, a.out, s)


if __name__ == "__main__":
    cli()
