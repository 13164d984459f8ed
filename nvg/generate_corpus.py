"""Stage `generate_corpus`: the teacher writes its own calibration text, LLM-QAT style.

Each sequence starts from one first token, takes `greedy_prefix` argmax tokens, then samples at
`temperature` (with optional `top_k` / `top_p`) up to `length` tokens. First tokens: `vocab` walks a
seeded permutation of the whole vocabulary (special tokens left out), so every id starts a sequence
before any repeats (LLM-QAT); `random` draws them uniformly. With `prompts` (a text source), each sequence
opens instead with `prompt_tokens` consecutive tokens of that text from a seeded place, which the teacher
continues (teacher continuations of real text, as BitDistiller calibrates): the prompt is written too.
With `chat`, the decoder first reads the teacher's chat template up to a user message's text (Magpie): the
teacher then writes a user's request from that first token and, after its own end of turn, the answer, the
text its instruct tuning made it fluent in; the opening is context, not written (`length` tokens from the
first token on, as without it). Sequences are split into `shards` independent jobs (as the teacher pass
is), each seeded by (seed, shard). The output is token ids, never text: no decode and re-tokenize round trip.
`tokenize_windows` cuts them into windows when `data.sources` names `generated`. Decoding is batched with a static KV cache (`nvg/decoding.py`),
compiled and replayed as a CUDA graph on the GPU, eager on the CPU.

    python -m nvg.generate_corpus --teacher T.cmf --shard 0 --out corpus/generated.0.h5 --settings JSON
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from nvg.artifacts import content_hash, model_hash, shard_rows, write_corpus
from nvg.cmf import read_verified
from nvg.decoding import Decoder
from nvg.errors import NvgError, exits_cleanly
from nvg.model import load_model, pick_device
from nvg.progress import bar
from nvg.sources import ChatRenderer, source_draw_tokens
from nvg.tokenizer import cmf_tokenizer
from nvg.settings import SETTINGS_HELP, load


@dataclass
class CorpusSettings:
    """Config block `generate_corpus` (defaults and bounds: the schema; build with `nvg.settings.load`)."""

    SECTION: ClassVar[str] = "generate_corpus"
    sequences: int
    length: int
    shards: int
    first_token: str
    chat: bool
    prompts: str
    prompt_tokens: int
    greedy_prefix: int
    temperature: float
    top_k: int
    top_p: float
    batch: int
    seed: int
    device: str
    precision: str


def first_tokens(tok, vocab_size: int, settings: CorpusSettings) -> np.ndarray:
    """The first token of every sequence (int64 [sequences]); special tokens never start one."""
    special = set(tok.get_added_tokens_decoder())
    ids = np.array([i for i in range(min(vocab_size, tok.get_vocab_size())) if i not in special], dtype=np.int64)
    gen = torch.Generator().manual_seed(settings.seed)
    if settings.first_token == "random":
        return ids[torch.randint(len(ids), (settings.sequences,), generator=gen).numpy()]
    laps = -(-settings.sequences // len(ids))  # whole permutations, as many as the sequences need
    order = np.concatenate([torch.randperm(len(ids), generator=gen).numpy() for _ in range(laps)])
    return ids[order[: settings.sequences]]


def prompt_starts(tok, cmf, settings: CorpusSettings) -> np.ndarray:
    """Every sequence's opening (int64 [sequences, prompt_tokens]): consecutive token ids of the `prompts`
    source from a seeded place, uniform over the tokens read (a prompt may span two of its documents)."""
    s = settings
    ids = source_draw_tokens(s.prompts, s.sequences * s.prompt_tokens, tok, ChatRenderer(cmf, s.prompts))
    if len(ids) < s.prompt_tokens:
        raise NvgError(f"config generate_corpus.prompts: {s.prompts}: {len(ids)} tokens, fewer than prompt_tokens "
                       f"{s.prompt_tokens}")
    places = torch.randint(len(ids) - s.prompt_tokens + 1, (s.sequences,),
                           generator=torch.Generator().manual_seed(s.seed)).numpy()
    return ids.astype(np.int64)[places[:, None] + np.arange(s.prompt_tokens)]


USER_TEXT = "\x00nvg user text\x00"  # where the template puts a user's words: no template writes this itself


def chat_opening(cmf, tok, source: Path) -> list[int]:
    """The token ids of the teacher's chat template before a user message's text (with the system prompt the
    template adds by itself, if any): rendered through the tokenizer's own template, so special tokens get
    their real ids."""
    if not cmf.header.get("tokenizer_config", {}).get("chat_template"):
        raise NvgError(f"{source}: config generate_corpus.chat is true but the teacher has no chat_template")
    rendered = ChatRenderer(cmf, source)([{"role": "user", "content": USER_TEXT}])
    opening = rendered[: rendered.index(USER_TEXT)]
    return tok.encode(opening, add_special_tokens=False).ids


def sample_sequences(decoder: Decoder, starts: np.ndarray, opening: list[int], s: CorpusSettings,
                     label: str) -> np.ndarray:
    """Sequences int32 [len(starts), length], `decoder.batch` at a time: after the `opening` (context only),
    each row of `starts` (its first token, or its prompt), `greedy_prefix` argmax tokens, then draws."""
    batch, device = decoder.batch, decoder.device
    start_pos, given = len(opening), starts.shape[1]
    tokens = np.zeros((len(starts), s.length), dtype=np.int32)
    pb = bar(len(starts), label, "seq")
    for start in range(0, len(starts), batch):
        n = min(batch, len(starts) - start)
        rows = torch.from_numpy(starts[start : start + n]).to(device)
        rows = torch.cat([rows, rows[-1:].expand(batch - n, -1)])  # pad to the static batch; padding is dropped
        for pos, opening_id in enumerate(opening):  # fills the cache; what the teacher would write here is unused
            decoder.next_ids(torch.full((batch,), opening_id, device=device), pos, greedy=True)
        tok = rows[:, 0]
        seq = [tok]
        for t in range(s.length - 1):
            # inside the given start the teacher only fills its cache (greedy: no draw spends the RNG), after
            # it the first greedy_prefix tokens are argmax
            tok = decoder.next_ids(tok, start_pos + t, greedy=t < given - 1 + s.greedy_prefix)
            if t + 1 < given:
                tok = rows[:, t + 1]
            seq.append(tok)
        tokens[start : start + n] = torch.stack(seq, 1)[:n].cpu().numpy()
        pb.update(n)
    pb.close()
    return tokens


def main(teacher: Path, shard: int, out: Path, settings: CorpusSettings) -> None:
    s = settings
    cmf = read_verified(teacher)
    tok = cmf_tokenizer(cmf, teacher, "pick first tokens with")  # parsed once: the chat opening uses it too
    opening = chat_opening(cmf, tok, teacher) if s.chat else []
    if len(opening) + s.length > cmf.arch["max_position_embeddings"]:
        raise NvgError(f"config generate_corpus.length: {s.length} (after a chat opening of {len(opening)} tokens) "
                       f"exceeds the teacher's max_position_embeddings {cmf.arch['max_position_embeddings']}")
    rows = shard_rows(s.sequences, shard, s.shards)
    if len(rows) == 0:
        raise NvgError(f"config generate_corpus.shards: {s.shards} shards for {s.sequences} sequences leaves shard {shard} empty")
    if s.prompts and s.prompt_tokens >= s.length:
        raise NvgError(f"config generate_corpus.prompt_tokens: {s.prompt_tokens} leaves nothing for the teacher to write "
                       f"in sequences of length {s.length}")
    starts = prompt_starts(tok, cmf, s) if s.prompts else first_tokens(tok, cmf.arch["vocab_size"], s)[:, None]
    starts = starts[rows]  # drawn for every sequence, then this shard's: the same places however it is split
    device = pick_device(s.device, shard)
    decoder = Decoder(load_model(cmf, device), min(s.batch, len(rows)), len(opening) + s.length, device,
                      s.precision, s.temperature, s.top_k, s.top_p)
    torch.manual_seed(s.seed * 100_003 + shard)  # the draws use the global RNG (inside a CUDA graph on the GPU)
    t0 = time.perf_counter()
    tokens = sample_sequences(decoder, starts, opening, s, f"generate_corpus shard {shard}")
    digest = content_hash(tokens)
    write_corpus(out, tokens, {"teacher_hash": model_hash(cmf), "shard": shard, "settings": json.dumps(asdict(s)),
                               "tokens_blake2b": digest})
    # the digest in the log: two runs with one seed can be compared from their logs alone
    print(f"generate_corpus: shard {shard}/{s.shards}: {len(rows)} sequences × {s.length} tokens, "
          f"{tokens.size / (time.perf_counter() - t0):.0f} tok/s on {device}, tokens blake2b {digest} → {out}",
          file=sys.stderr)


@exits_cleanly
def cli(argv=None):
    ap = argparse.ArgumentParser(prog="nvg generate-corpus", description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", required=True, type=Path, help="the teacher CMF (results/teacher.cmf)")
    ap.add_argument("--shard", required=True, type=int, help="which shard of the work this job does (0-based)")
    ap.add_argument("--out", required=True, type=Path, help="this shard's generated sequences (HDF5)")
    ap.add_argument("--settings", required=True, help=SETTINGS_HELP)
    a = ap.parse_args(argv)
    s = load(CorpusSettings, a.settings)
    if not 0 <= a.shard < s.shards:
        raise NvgError(f"--shard {a.shard}: must be in [0, {s.shards})")
    main(a.teacher, a.shard, a.out, s)


if __name__ == "__main__":
    cli()
