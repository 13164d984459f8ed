"""Text sources: where calibration and evaluation text comes from, and how it becomes token ids.

A source is a file or folder (.txt .md .rst and Texinfo's .info; .jsonl with `text` or chat `messages`; .json
arrays of [prompt, text] pairs; any of them gzipped, as `/usr/share/info/*.gz` is), a glob,
`pkg:<module>/<path>` inside an installed package (found without importing it), or `python-docs` (the
Python language reference shipped with CPython). The source
`generated` is the teacher's own text (stage generate_corpus), read by tokenize_windows as token ids. Chat messages
are rendered with the teacher's own template, so special tokens get their real ids."""

from __future__ import annotations

import glob
import gzip
import importlib.util
import json
import re
from pathlib import Path

import numpy as np

from nvg.errors import NvgError
from nvg.tokenizer import hf_tokenizer

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".jsonl", ".json", ".info"}
PYTHON_DOCS = "python-docs"
GENERATED = "generated"  # the teacher's own text: token ids from stage generate_corpus, not a file


def resolve_path(spec: str) -> Path:
    """A path, or `pkg:<module>/<path>` inside an installed package (located without importing it)."""
    if not spec.startswith("pkg:"):
        return Path(spec)
    module, _, rel = spec[4:].partition("/")
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise NvgError(f"{spec}: package {module!r} is not installed (see README: setup)")
    return Path(list(found.submodule_search_locations)[0]) / rel


class ChatRenderer:
    """Renders chat `messages` with the model's template through the tokenizer's own
    `apply_chat_template` (bos/eos tokens and the template's other variables as transformers gives them),
    so special tokens get their real ids. The tokenizer is built on the first chat record."""

    def __init__(self, cmf, source):
        self.cmf, self.source, self.tokenizer = cmf, source, None

    def __call__(self, messages, add_generation_prompt: bool = False) -> str:
        if not self.cmf.header.get("tokenizer_config", {}).get("chat_template"):
            raise NvgError(f"{self.source}: chat messages found but the teacher has no chat_template")
        if self.tokenizer is None:
            self.tokenizer = hf_tokenizer(self.cmf, self.source, "render chat records with")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def text_kind(path: Path) -> str:
    """The suffix that says how to read a file: its own, or the one under `.gz`; a Texinfo part (`.info-2`)
    is `.info`."""
    suffix = Path(path.stem).suffix if path.suffix == ".gz" else path.suffix
    return re.sub(r"^\.info-\d+$", ".info", suffix)


def source_files(spec: str) -> list[Path]:
    path = resolve_path(spec)
    if any(c in str(path) for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True))
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and text_kind(p) in TEXT_SUFFIXES)
    elif path.exists():
        files = [path]
    else:
        raise NvgError(f"{spec}: calibration source not found")
    files = [f for f in files if text_kind(f) in TEXT_SUFFIXES | {""}]
    if not files:
        raise NvgError(f"{spec}: no .txt/.md/.rst/.info/.jsonl/.json files (or .gz of them) in this source")
    return files


def text_files(spec: str) -> list[Path]:
    """The files a text source reads: none for `generated` (token ids from generate_corpus), `python-docs` (inside
    CPython) and "" (no source); what the workflow makes a stage's inputs and compares between keys."""
    return [] if spec in (GENERATED, PYTHON_DOCS, "") else source_files(spec)


def file_texts(path: Path, render_chat: ChatRenderer):
    """Yield the documents of one file as strings."""
    if path.suffix == ".gz":
        try:
            with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
                raw = f.read()
        except (OSError, EOFError) as e:
            raise NvgError(f"{path}: not a readable gzip file: {e}") from None
    else:
        raw = path.read_text(encoding="utf-8", errors="replace")
    kind = text_kind(path)
    if kind == ".jsonl":
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
                if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                           for m in rec["messages"]):
                    raise NvgError(f"{path}: line {n}: every message needs a 'role' and a 'content' string")
                yield render_chat(rec["messages"])
            else:
                raise NvgError(f"{path}: line {n}: needs a 'text' string or a 'messages' list")
    elif kind == ".json":
        try:
            items = json.loads(raw)
        except ValueError as e:
            raise NvgError(f"{path}: not valid JSON: {e}") from None
        if not isinstance(items, list):
            raise NvgError(f"{path}: expected a JSON array of [prompt, text] pairs")
        for n, item in enumerate(items):
            parts = item if isinstance(item, list) else [item]
            if not all(isinstance(p, str) for p in parts):
                raise NvgError(f"{path}: item {n}: expected a string or a [prompt, text] list of strings, got {type(item).__name__}")
            yield "".join(p + "\n" for p in parts)
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


# A real source to draw from (tokenize_windows' windows, generate_corpus' prompts) is read up to SOURCE_READ_FACTOR
# times the tokens drawn, and at least SOURCE_READ_MIN tokens (a few seconds of tokenizing), and the draw is taken
# from across all of that. Taken from its start, a small share
# went to the first file alone: in session 37 a 30 % share of the CPU job (17 windows) from ten GNU manuals was the
# first pages of one, which helped or hurt by which one it was; drawn from across them, the share brought
# python-docs 33-42 % closer on two seeds (docs/quality.md). The bounds keep a huge source from being read whole.
SOURCE_READ_FACTOR = 64
SOURCE_READ_MIN = 1 << 21


def source_draw_tokens(spec: str, budget: int, tokenizer, render_chat) -> np.ndarray:
    """The tokens of a source that a draw of `budget` tokens is taken from across (see the bounds above)."""
    return source_tokens(spec, max(SOURCE_READ_FACTOR * budget, SOURCE_READ_MIN), tokenizer, render_chat)


def split_budget(weights: list[float], total: int) -> list[int]:
    """`total` tokens shared by weight; the rounding remainder goes to the first sources."""
    w = np.asarray(weights, dtype=np.float64)
    shares = np.floor(total * w / w.sum()).astype(int)
    shares[: total - shares.sum()] += 1
    return shares.tolist()
