"""Stage `reconstruct_blocks` (optional, `reconstruct.steps` > 0): before distillation, each student block
in turn learns its scales to reproduce the teacher's block on the student's own hidden states.

The algorithm is `nvg/blockwise.py`'s; this driver holds `windows` calibration windows (a seeded choice
of the training rows, never the held-out ones) as two residual streams, the teacher's and the student's,
on the device: for block i the teacher's block gives the target from the teacher's stream, the student's
block trains on the student's stream, and both streams then move on one block. Memory: three float32
streams, 12 · windows · window · hidden bytes (256 windows of 1,024 on SmolLM2: 1.8 GB).

Resume: after each block, the trained tensors of the blocks done and the batch generator's state are
saved (`nvg/resume.py`, under `state_root`); a rerun puts them back, rebuilds both streams by running the
finished blocks forward (seconds, not the minutes their training took) and goes on with the next block,
so a killed job ends with the same bytes as one that was not killed.

With `reconstruct.signs` enabled each block's sign matrices train as well (`nvg/blockwise.py`); `init:
margin` reads the teacher's input Grams (`--grams`).

    python -m nvg.reconstruct_blocks --student S.cmf --teacher T.cmf --windows W.h5 --out R.cmf --settings JSON [--grams G.h5]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from nvg.artifacts import check_encoded_from, read_windows
from nvg.blockwise import is_trained, reconstruct_block, run_block
from nvg.blr import pack_signs, unpack_signs
from nvg.cmf import read_verified
from nvg.distributed import Group
from nvg.errors import NvgError, exits_cleanly
from nvg.model import autocast, compile_blocks, computing_in, load_model, pick_device, rotary_tables, write_student
from nvg.resume import load_state, one_run, save_state, state_file
from nvg.settings import SETTINGS_HELP, load
from nvg.sign_training import SignSettings, SignTrainer, sign_reference


@dataclass
class BlockSignSettings(SignSettings):
    """Config block `reconstruct.signs`: the keys of `train.signs` (one definition in the schema)."""

    SECTION: ClassVar[str] = "reconstruct.signs"


@dataclass
class ReconstructSettings:
    """Config block `reconstruct` (defaults and bounds: the schema; build with `nvg.settings.load`)."""

    SECTION: ClassVar[str] = "reconstruct"
    steps: int
    windows: int
    batch: int
    lr: float
    seed: int
    device: str
    precision: str  # (steps 0: the workflow leaves the stage out; run by hand it writes the student unchanged)
    state_root: str
    signs: BlockSignSettings


@torch.no_grad()
def embed_rows(model, ids: torch.Tensor, batch: int, ctx) -> torch.Tensor:
    """The model's token embeddings of `ids` [n, t] as one float32 stream [n, t, hidden]."""
    out = []
    for s in range(0, len(ids), batch):
        with ctx:
            out.append(model.embed(ids[s : s + batch]).float())
    return torch.cat(out)


def is_sign(name: str) -> bool:
    return name.endswith((".su", ".sv"))


def trained_tensors(s_model, block: int, signs: bool) -> dict[str, torch.Tensor]:
    """What reconstruction changed in block `block`, by parameter name (`signs`: the sign matrices too)."""
    return {f"{block}.{n}": p for n, p in s_model.model.layers[block].named_parameters()
            if is_trained(n) or (signs and is_sign(n))}


def block_state(s_model, block: int, signs: bool) -> dict[str, torch.Tensor]:
    """`trained_tensors` as the resume state holds them, taken once when the block is done (nothing
    changes it after): sign matrices packed 8 to a byte (the state is rewritten after every block with
    every finished block in it; as bf16 the signs alone would make it 16× larger)."""
    return {n: torch.from_numpy(pack_signs(p.detach().float().cpu().numpy())) if is_sign(n) else p.detach().cpu()
            for n, p in trained_tensors(s_model, block, signs).items()}


def block_sign_trainer(s_model, layer: int, s: ReconstructSettings, reference):
    """`reconstruct_block`'s `signs`: a maker of the SignTrainer of block `layer`'s sign matrices, or None."""
    if not s.signs.enabled:
        return None
    prefix = f"model.layers.{layer}."
    linears = {n: m for n, m in s_model.blr_linears().items() if n.startswith(prefix)}
    return lambda: SignTrainer(linears, s.signs, s.steps, Group(), reference=reference)


def run_state_file(s: ReconstructSettings, student: Path, teacher: Path, windows: Path, grams: Path | None) -> Path:
    """Where the state of this run lives: keyed by its inputs and every setting but where it runs."""
    return state_file(s.state_root, [student, teacher, windows, *([grams] if grams else [])],
                      {k: v for k, v in asdict(s).items() if k not in ("device", "state_root")})


def main(student: Path, teacher: Path, windows: Path, out: Path, s: ReconstructSettings, grams: Path | None = None) -> None:
    t0 = time.perf_counter()
    s.signs.check_grams_given(grams)
    device = pick_device(s.device)
    s_cmf, t_cmf = read_verified(student), read_verified(teacher)
    check_encoded_from(s_cmf, t_cmf)
    tokens, attrs = read_windows(windows, s_cmf.arch["vocab_size"])
    n_train = int(attrs["n_train"])
    if s.windows > n_train:
        raise NvgError(f"config reconstruct.windows: {s.windows} exceeds the {n_train} training windows of {windows}")
    if s.batch > s.windows:
        raise NvgError(f"config reconstruct.batch: {s.batch} exceeds reconstruct.windows {s.windows}")
    rows = np.sort(np.random.default_rng(s.seed).permutation(n_train)[: s.windows])
    ids = torch.from_numpy(tokens[rows]).long().to(device)
    t_model = compile_blocks(load_model(t_cmf, device)).requires_grad_(False)
    s_model = compile_blocks(load_model(s_cmf, device)).requires_grad_(False)
    ctx = autocast(device, s.precision)
    print(f"reconstruct_blocks: {computing_in(device, 'reconstruct.precision', s.precision)}", file=sys.stderr)
    x_t, x_s = embed_rows(t_model, ids, s.batch, ctx), embed_rows(s_model, ids, s.batch, ctx)
    cos, sin = rotary_tables(s_model.cfg, ids.shape[1], device)
    generator = torch.Generator().manual_seed(s.seed)
    reference = sign_reference(grams, t_cmf, t_model) if s.signs.margin else None
    state_path = run_state_file(s, student, teacher, windows, grams)
    # Where the stage's time goes, for the log only (the output's bytes must not depend on it): on the GPU it took
    # 124.5 s on one H100 and 197.9 s on another (sessions 58 and 61) for the same work.
    setup_s, fit_s = time.perf_counter() - t0, []
    with one_run(state_path, "reconstruction"):
        blocks, state = [], {}  # per block record; the finished blocks' tensors as saved
        if state_path.exists():
            def restore(tensors, meta):
                if not 0 < meta["done"] == len(meta["blocks"]) <= len(s_model.model.layers):  # a kill may come after the last block
                    raise ValueError(f"{meta['done']} blocks done with {len(meta['blocks'])} records, of {len(s_model.model.layers)}")
                with torch.no_grad():
                    for i in range(meta["done"]):
                        for name, p in trained_tensors(s_model, i, s.signs.enabled).items():
                            saved = state[name] = tensors[name]
                            p.copy_(torch.from_numpy(unpack_signs(saved.numpy(), p.shape[-1])) if is_sign(name) else saved)
                generator.set_state(tensors["generator"])
                return meta["blocks"]
            blocks = load_state(state_path, "reconstruction", restore)
            print(f"reconstruct_blocks: resumed {state_path} after block {len(blocks) - 1}", file=sys.stderr)
        for i, (t_block, s_block) in enumerate(zip(t_model.model.layers, s_model.model.layers)):
            y_t = run_block(t_block, x_t, cos, sin, s.batch, ctx)
            if i < len(blocks):  # reconstructed before a kill: its output is the next block's input again
                x_s, x_t = run_block(s_block, x_s, cos, sin, s.batch, ctx), y_t
                continue
            fit_t0 = time.perf_counter()
            stats, x_s = reconstruct_block(s_block, x_s, y_t, cos, sin, steps=s.steps, batch=s.batch, lr=s.lr,
                                           autocast=ctx, generator=generator, signs=block_sign_trainer(s_model, i, s, reference))
            fit_s.append(time.perf_counter() - fit_t0)  # reconstruct_block ends reading its error: the device is done
            x_t = y_t
            blocks.append(stats)
            state.update(block_state(s_model, i, s.signs.enabled))
            save_state(state_path, {**state, "generator": generator.get_state()},
                       {"done": i + 1, "blocks": blocks})
            print(f"  block {i}: relative error {stats['before']:.5f} → {stats['after']:.5f}"
                  + (f", {100 * stats['signs']['flipped_fraction']:.2f}% of its signs flipped" if "signs" in stats else "")
                  + (f" (the spike guard fired {stats['signs']['spikes']} times)" if stats.get("signs", {}).get("spikes") else "")
                  + (f" (sign gradients clipped in {stats['signs']['grad_clipped']} matrix-steps)"
                     if stats.get("signs", {}).get("grad_clipped") else "")
                  + (" (worse with its signs trained: its starting signs kept, its scales trained alone)"
                     if stats.get("signs", {}).get("dropped") else "")
                  + ("" if stats["kept"] else " (worse: starting values kept)"), file=sys.stderr)
            for line in stats.get("signs", {}).get("guards", []):
                print(f"    {line}", file=sys.stderr)
        seconds = time.perf_counter() - t0
        write_student(s_cmf, s_model, out, "nvg_reconstruct", {
            "windows_hash": str(attrs["tokens_blake2b"]), "rows": rows.tolist(), "tokens_per_block": s.steps * s.batch * int(ids.shape[1]),
            "blocks": blocks, "settings": asdict(s)})
        print(f"reconstruct_blocks: {len(blocks)} blocks × {s.steps} steps of {s.batch} windows, relative error of the last "
              f"block {blocks[-1]['before']:.4f} → {blocks[-1]['after']:.4f}, {seconds:.1f} s on {device} → {out}", file=sys.stderr)
        if fit_s:
            later = fit_s[1:] or fit_s
            print(f"reconstruct_blocks: {setup_s:.1f} s reading, loading and embedding; the first block trained here "
                  f"{fit_s[0]:.1f} s (on CUDA the blocks' compile with it), the others {sum(later) / len(later):.2f} s each "
                  f"({1e3 * sum(later) / len(later) / max(1, s.steps):.1f} ms a step with the block's error passes); "
                  f"the streams' forward passes and saves the rest", file=sys.stderr)
        shutil.rmtree(state_path.parent)  # the output holds everything the state did


@exits_cleanly
def cli(argv=None):
    ap = argparse.ArgumentParser(prog="nvg reconstruct-blocks", description=__doc__.splitlines()[0])
    ap.add_argument("--student", required=True, type=Path, help="the encoded student CMF")
    ap.add_argument("--teacher", required=True, type=Path, help="the teacher CMF it was encoded from")
    ap.add_argument("--windows", required=True, type=Path, help="the token windows (results/data/windows.h5)")
    ap.add_argument("--out", required=True, type=Path, help="the reconstructed student CMF")
    ap.add_argument("--grams", type=Path, help="the teacher's input Grams (reconstruct.signs.init: margin)")
    ap.add_argument("--settings", required=True, help=SETTINGS_HELP)
    a = ap.parse_args(argv)
    main(a.student, a.teacher, a.windows, a.out, load(ReconstructSettings, a.settings), a.grams)


if __name__ == "__main__":
    cli()
