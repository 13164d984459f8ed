"""Stage `tokenize_windows`: calibration text → `windows.h5` (`tokens` int32 [N, window], `origin` [N]).

Every source (`nvg/sources.py`: files, folders, globs, `pkg:` paths, `python-docs`) is tokenized with
the teacher's own tokenizer (from its CMF vocab section); the budget `tokens + eval_windows · window`
is split over the sources by weight; each source is cut into `window`-token windows, and a source with
more than its share gives a seeded draw of windows from across it, not its first pages, and one with less is
taken whole; all windows are shuffled with a seeded generator and the last `eval_windows` are held out. Then
a short source with `repeat` r > 1 has its training windows repeated, up to r times each, to fill its share
(never its held-out ones). Each window's source is kept (`origin`), so that evaluate scores the held-out
windows of each source apart.

    python -m nvg.tokenize_windows --teacher results/teacher.cmf --out results/data/windows.h5 --settings JSON
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from nvg.artifacts import model_hash, read_corpus, write_windows
from nvg.cmf import read_verified
from nvg.errors import NvgError, exits_cleanly
from nvg.hash64 import hash64, hex16
from nvg.settings import SETTINGS_HELP, load
from nvg.sources import GENERATED, ChatRenderer, source_draw_tokens, split_budget
from nvg.tokenizer import cmf_tokenizer


@dataclass
class WindowSettings:
    """Config block `data` (defaults and bounds: the schema; build with `nvg.settings.load`)."""

    SECTION: ClassVar[str] = "data"
    sources: list  # [{"path": str, "weight": float}]
    tokens: int
    window: int
    eval_windows: int
    seed: int


def source_windows(spec: str, budget: int, window: int, tokenizer, render_chat, generated: np.ndarray | None,
                   rng: np.random.Generator) -> np.ndarray:
    """Up to `budget` tokens of one source as [n, window] windows. A real source's windows are a draw (`rng`)
    from across the first `source_draw_tokens(spec, budget, …)` of its tokens, kept in their
    order. Generated sequences (already independent draws) at least a window long are cut one by one (a window
    never spans two of them); shorter ones are packed end to end, several to a window, as pretraining packs
    documents (each still starts from its own first token)."""
    if spec != GENERATED:
        ids = source_draw_tokens(spec, budget, tokenizer, render_chat)
        n = len(ids) // window
        windows = ids[: n * window].reshape(n, window)
        keep = budget // window
        return windows[np.sort(rng.choice(n, keep, replace=False))] if n > keep else windows
    if generated is None:
        raise NvgError(f"config data.sources: {GENERATED!r} needs the generate_corpus shards (--generated)")
    length = generated.shape[1]
    ids = generated[:, : length // window * window] if length >= window else generated  # whole windows of each, or all
    ids = ids.reshape(-1)
    return ids[: len(ids) // window * window].reshape(-1, window)[: budget // window]


def repeated_rows(origin: np.ndarray, n_train: int, share_windows: list[int], repeat: list[int],
                  rng: np.random.Generator) -> np.ndarray:
    """Rows of training windows (the first `n_train` of `origin`) to add as copies: for each source with `repeat`
    r > 1 that is short of its share, its training windows again, in a seeded order, until its windows fill the
    share or each training window is there r times."""
    extra = []
    for i, (share, r) in enumerate(zip(share_windows, repeat)):
        mine = np.flatnonzero(origin[:n_train] == i)
        if r > 1 and len(mine):
            want = min(share - int((origin == i).sum()), (r - 1) * len(mine))
            cycle = np.concatenate([rng.permutation(mine) for _ in range(r - 1)])
            extra.append(cycle[: max(want, 0)])
    return np.concatenate(extra) if extra else np.zeros(0, np.int64)


def main(teacher: Path, out: Path, settings: WindowSettings, generated: list[Path] = ()) -> None:
    cmf = read_verified(teacher)
    tokenizer = cmf_tokenizer(cmf, teacher, "tokenize with")
    max_pos = cmf.arch["max_position_embeddings"]
    if settings.window > max_pos:
        raise NvgError(f"config data.window: {settings.window} exceeds the teacher's max_position_embeddings {max_pos}")
    paths = [src["path"] for src in settings.sources]
    twice = sorted({p for p in paths if paths.count(p) > 1})
    if twice:
        raise NvgError(f"config data.sources: {twice[0]!r} is listed twice (give it one entry and one weight)")
    want = settings.tokens + settings.eval_windows * settings.window
    budgets = split_budget([float(s.get("weight", 1.0)) for s in settings.sources], want)
    corpus = read_corpus(list(generated), model_hash(cmf)) if generated else None
    windows, rng = [], np.random.default_rng(settings.seed)
    for src, budget in zip(settings.sources, budgets):
        w = source_windows(src["path"], budget, settings.window, tokenizer, ChatRenderer(cmf, src["path"]), corpus, rng)
        if len(w) == 0:
            raise NvgError(f"{src['path']}: not one {settings.window}-token window in its {budget}-token share "
                           "(the source is too short, or its weight too small for data.tokens)")
        if w.size < budget - settings.window:
            print(f"tokenize_windows: {src['path']}: all of it, {w.size} tokens, short of its {budget}-token share"
                  + (f" (its training windows up to {src['repeat']} times)" if src.get("repeat", 1) > 1 else ""))
        windows.append(w)
    tokens = np.concatenate(windows)
    origin = np.concatenate([np.full(len(w), i, np.int16) for i, w in enumerate(windows)])
    need = settings.eval_windows + 1
    if len(tokens) < need:
        raise NvgError(f"config data: too few windows: {len(tokens)} of {settings.window} tokens, need eval_windows + 1 = {need}")
    order = torch.randperm(len(tokens), generator=torch.Generator().manual_seed(settings.seed)).numpy()
    tokens, origin = tokens[order], origin[order]
    n_train = len(tokens) - settings.eval_windows
    extra = repeated_rows(origin, n_train, [b // settings.window for b in budgets],
                          [src.get("repeat", 1) for src in settings.sources], rng)
    if len(extra):  # copies of training windows only, shuffled in among them: no held-out window is trained on
        train = np.concatenate([np.arange(n_train), extra])[rng.permutation(n_train + len(extra))]
        rows = np.concatenate([train, np.arange(n_train, len(tokens))])
        tokens, origin, n_train = tokens[rows], origin[rows], len(train)
    write_windows(out, tokens, origin, {
        "n_train": n_train, "n_eval": settings.eval_windows,
        "window": settings.window, "seed": settings.seed,
        "sources": json.dumps(settings.sources), "tokenizer_hash": hex16(hash64(cmf.vocab)),
    })
    print(f"tokenize_windows: {len(tokens)} windows of {settings.window} tokens ({settings.eval_windows} held out) → {out}")


@exits_cleanly
def cli(argv=None):
    ap = argparse.ArgumentParser(prog="nvg tokenize-windows", description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", required=True, type=Path, help="the teacher CMF whose tokenizer is used")
    ap.add_argument("--out", required=True, type=Path, help="the token windows (HDF5), the last eval_windows held out")
    ap.add_argument("--settings", required=True, help=SETTINGS_HELP)
    ap.add_argument("--generated", type=Path, nargs="*", default=[], help="generate_corpus shards (source 'generated')")
    a = ap.parse_args(argv)
    main(a.teacher, a.out, load(WindowSettings, a.settings), a.generated)


if __name__ == "__main__":
    cli()
