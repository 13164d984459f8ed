"""Stage `teacher_topk`: the teacher's top-k next-token log-probs for one shard of the windows.

Output `topk.{shard}.h5` (format in `nvg/artifacts.py`): log-probs over the full vocabulary, so the
tail mass 1 − Σ exp(logp) is known. Shard s of S takes the s-th contiguous block of all windows (train
and held-out), so a crash loses one shard and a cluster runs shards in parallel.

    python -m nvg.teacher_topk --teacher T.cmf --windows W.h5 --shard 0 --out topk.0.h5 --settings JSON
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from nvg.artifacts import model_hash, read_windows, shard_rows, topk_shard
from nvg.cmf import read_verified
from nvg.errors import NvgError, exits_cleanly
from nvg.losses import topk_logprobs
from nvg.model import autocast, compile_blocks, computing_in, load_model, pick_device
from nvg.progress import bar
from nvg.settings import SETTINGS_HELP, load


@dataclass
class TopkSettings:
    """Config block `teacher_topk` (defaults and bounds: the schema; build with `nvg.settings.load`)."""

    SECTION: ClassVar[str] = "teacher_topk"
    k: int
    shards: int
    batch: int
    device: str
    precision: str


def main(teacher: Path, windows: Path, shard: int, out: Path, settings: TopkSettings) -> None:
    cmf = read_verified(teacher)
    tokens, w_attrs = read_windows(windows, cmf.arch["vocab_size"])
    vocab = cmf.arch["vocab_size"]
    if settings.k > vocab:
        raise NvgError(f"config teacher_topk.k: {settings.k} exceeds the teacher's vocabulary of {vocab} ({teacher})")
    if settings.shards > len(tokens):
        raise NvgError(f"config teacher_topk.shards: {settings.shards} shards for the {len(tokens)} windows of {windows} "
                       f"leaves shard {len(tokens)} empty")
    rows = shard_rows(len(tokens), shard, settings.shards)
    device = pick_device(settings.device, shard)
    model = load_model(cmf, device)
    if settings.precision != "fp32" and device.type == "cuda":
        model = model.to(torch.bfloat16 if settings.precision == "bf16" else torch.float16)
    model = compile_blocks(model)
    print(f"teacher_topk shard {shard}: {computing_in(device, 'teacher_topk.precision', settings.precision)}", file=sys.stderr)
    window, k = tokens.shape[1], settings.k
    t0, done = time.perf_counter(), 0
    attrs = {"k": k, "teacher_hash": model_hash(cmf), "windows_hash": w_attrs["tokens_blake2b"]}
    with topk_shard(out, rows, window, k, attrs) as shard_file, bar(len(rows), f"teacher_topk shard {shard}", "window") as pb:
        for s in range(0, len(rows), settings.batch):
            ids = torch.from_numpy(tokens[rows[s : s + settings.batch]]).to(device, non_blocking=True)
            with torch.no_grad(), autocast(device, settings.precision):
                top_ids, top_logp = topk_logprobs(model.hidden(ids), model.head_weight, k)
            shard_file.write(s, top_ids.cpu().numpy(), top_logp.half().cpu().numpy())
            done += ids.numel()
            pb.update(len(ids))
    print(f"teacher_topk: shard {shard}/{settings.shards}: {len(rows)} windows, {done} tokens, "
          f"{done / (time.perf_counter() - t0):.0f} tok/s on {device} → {out}", file=sys.stderr)


@exits_cleanly
def cli(argv=None):
    ap = argparse.ArgumentParser(prog="nvg teacher-topk", description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", required=True, type=Path, help="the teacher CMF (results/teacher.cmf)")
    ap.add_argument("--windows", required=True, type=Path, help="the token windows (results/data/windows.h5)")
    ap.add_argument("--shard", required=True, type=int, help="which shard of the work this job does (0-based)")
    ap.add_argument("--out", required=True, type=Path, help="this shard's top-k (HDF5)")
    ap.add_argument("--settings", required=True, help=SETTINGS_HELP)
    a = ap.parse_args(argv)
    s = load(TopkSettings, a.settings)
    if not 0 <= a.shard < s.shards:
        raise NvgError(f"--shard {a.shard}: must be in [0, {s.shards})")
    main(a.teacher, a.windows, a.shard, a.out, s)


if __name__ == "__main__":
    cli()
