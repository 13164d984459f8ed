"""Stage `tokenize_windows`: calibration text → `windows.h5` (`tokens` int32 [N, window]).

Every source is tokenized with the teacher's own tokenizer (from its CMF vocab section); the budget
`tokens + eval_windows · window` is split over the sources by weight; each source is cut into
`window`-token windows; all windows are shuffled with a seeded generator and the last `eval_windows`
are held out. Sources: files or folders (.txt .md .rst; .jsonl with `text` or chat `messages`; .json
arrays of [prompt, text] pairs), globs, `pkg:<module>/<path>` inside an installed package, and
`python-docs` (the Python language reference shipped with CPython).

    python -m nvg.tokenize_windows --teacher results/teacher.cmf --out results/data/windows.h5 --settings JSON
"""

from __future__ import annotations

import argparse
import glob
import json
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
import torch

from nvg.atomic import atomic_path
from nvg.cmf import read_cmf
from nvg.errors import NvgError, exits_cleanly
from nvg.hash64 import hash64, hex16
from nvg.import_teacher import resolve_path
from nvg.settings import check, from_json

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".jsonl", ".json"}
PYTHON_DOCS = "python-docs"


@dataclass
class WindowSettings:
    sources: list = field(default_factory=list)  # [{"path": str, "weight": float}]
    tokens: int = 8192
    window: int = 256
    eval_windows: int = 8
    batch: int = 4
    seed: int = 1234

    def __post_init__(self):
        check(len(self.sources) > 0, "data", "sources", "at least one calibration source is needed")
        for i, s in enumerate(self.sources):
            check(isinstance(s, dict) and isinstance(s.get("path"), str), "data", f"sources[{i}]", "needs a 'path' string")
            check(float(s.get("weight", 1.0)) > 0, "data", f"sources[{i}].weight", "must be > 0")
        check(self.tokens > 0, "data", "tokens", f"must be > 0, got {self.tokens}")
        check(self.window >= 8, "data", "window", f"must be >= 8, got {self.window}")
        check(self.eval_windows >= 1, "data", "eval_windows", f"must be >= 1, got {self.eval_windows}")
        check(self.batch >= 1, "data", "batch", f"must be >= 1, got {self.batch}")


class ChatRenderer:
    """Renders chat `messages` with the teacher's template so special tokens get their real ids."""

    def __init__(self, template: str | None, source):
        self.template, self.source = template, source

    def __call__(self, messages, add_generation_prompt: bool = False) -> str:
        if not self.template:
            raise NvgError(f"{self.source}: chat messages found but the teacher has no chat_template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.template).render(messages=messages, add_generation_prompt=add_generation_prompt)


def source_files(spec: str) -> list[Path]:
    path = resolve_path(spec)
    if any(c in str(path) for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True))
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    elif path.exists():
        files = [path]
    else:
        raise NvgError(f"{spec}: calibration source not found")
    files = [f for f in files if f.suffix in TEXT_SUFFIXES or f.suffix == ""]
    if not files:
        raise NvgError(f"{spec}: no .txt/.md/.rst/.jsonl/.json files in this source")
    return files


def file_texts(path: Path, render_chat: ChatRenderer):
    """Yield the documents of one file as strings."""
    raw = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".jsonl":
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise NvgError(f"{path}: line {n}: not valid JSON: {e}") from None
            if isinstance(rec, dict) and isinstance(rec.get("text"), str):
                yield rec["text"] + "\n"
            elif isinstance(rec, dict) and isinstance(rec.get("messages"), list):
                yield render_chat(rec["messages"])
            else:
                raise NvgError(f"{path}: line {n}: needs a 'text' string or a 'messages' list")
    elif path.suffix == ".json":
        try:
            items = json.loads(raw)
        except ValueError as e:
            raise NvgError(f"{path}: not valid JSON: {e}") from None
        if not isinstance(items, list):
            raise NvgError(f"{path}: expected a JSON array of [prompt, text] pairs")
        for item in items:
            parts = item if isinstance(item, list) else [item]
            yield "".join(str(p) + "\n" for p in parts)
    else:
        yield raw


def source_documents(spec: str, render_chat):
    """Yield the documents of one source. `python-docs` is the Python language reference that ships
    with every CPython (`pydoc_data.topics`, 0.46 MB of modern technical English): an out-of-domain
    text that needs no download."""
    if spec == PYTHON_DOCS:
        from pydoc_data.topics import topics

        yield from (topics[k] for k in sorted(topics))
        return
    for f in source_files(spec):
        yield from file_texts(f, render_chat)


def source_tokens(spec: str, budget: int, tokenizer, render_chat) -> np.ndarray:
    """Up to `budget` token ids of one source, reading only as much text as it needs."""
    ids: list[int] = []
    for text in source_documents(spec, render_chat):
        ids.extend(tokenizer.encode(text, add_special_tokens=False).ids)
        if len(ids) >= budget:
            return np.asarray(ids[:budget], dtype=np.int32)
    return np.asarray(ids, dtype=np.int32)


def split_budget(weights: list[float], total: int) -> list[int]:
    w = np.asarray(weights, dtype=np.float64)
    shares = np.floor(total * w / w.sum()).astype(int)
    shares[: total - shares.sum()] += 1  # hand out the rounding remainder, first sources first
    return shares.tolist()


def read_windows(path) -> tuple[np.ndarray, dict]:
    """(tokens [N, window] int32, attributes) of a windows.h5."""
    try:
        with h5py.File(path, "r") as f:
            return f["tokens"][...], dict(f.attrs)
    except (OSError, KeyError) as e:
        raise NvgError(f"{path}: not a readable windows.h5 ({e})") from None


def main(teacher: Path, out: Path, settings: WindowSettings) -> None:
    from tokenizers import Tokenizer

    cmf = read_cmf(teacher)
    if not cmf.vocab:
        raise NvgError(f"{teacher}: vocab section is empty (no tokenizer to tokenize with)")
    tokenizer = Tokenizer.from_str(cmf.vocab.decode("utf-8"))
    max_pos = cmf.arch["max_position_embeddings"]
    if settings.window > max_pos:
        raise NvgError(f"config data.window: {settings.window} exceeds the teacher's max_position_embeddings {max_pos}")
    template = cmf.header.get("tokenizer_config", {}).get("chat_template")
    want = settings.tokens + settings.eval_windows * settings.window
    budgets = split_budget([float(s.get("weight", 1.0)) for s in settings.sources], want)
    windows = []
    for src, budget in zip(settings.sources, budgets):
        ids = source_tokens(src["path"], budget, tokenizer, ChatRenderer(template, src["path"]))
        n = len(ids) // settings.window
        if n == 0:
            raise NvgError(f"{src['path']}: only {len(ids)} tokens, not one {settings.window}-token window")
        windows.append(ids[: n * settings.window].reshape(n, settings.window))
    tokens = np.concatenate(windows)
    need = settings.batch + settings.eval_windows
    if len(tokens) < need:
        raise NvgError(f"config data: too few windows: {len(tokens)} of {settings.window} tokens, need batch + eval_windows = {need}")
    order = torch.randperm(len(tokens), generator=torch.Generator().manual_seed(settings.seed)).numpy()
    tokens = tokens[order]
    with atomic_path(out) as tmp:
        with h5py.File(tmp, "w") as f:
            f.create_dataset("tokens", data=tokens, chunks=(1, settings.window))
            f.attrs.update({
                "n_train": len(tokens) - settings.eval_windows, "n_eval": settings.eval_windows,
                "window": settings.window, "seed": settings.seed,
                "sources": json.dumps(settings.sources), "tokenizer_hash": hex16(hash64(cmf.vocab)),
                "tokens_hash": hex16(hash64(tokens.tobytes())),
            })
    print(f"tokenize_windows: {len(tokens)} windows of {settings.window} tokens ({settings.eval_windows} held out) → {out}")


@exits_cleanly
def cli(argv=None):
    ap = argparse.ArgumentParser(prog="nvg tokenize-windows", description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--settings", required=True, help="JSON object of WindowSettings")
    a = ap.parse_args(argv)
    main(a.teacher, a.out, from_json(WindowSettings, a.settings, "data"))


if __name__ == "__main__":
    cli()
