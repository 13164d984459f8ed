"""`nvg generate FILE.cmf "prompt"`: text from any CMF (teacher or BLR student), greedy or sampled.

    nvg generate results/model.cmf "Once upon a time" --max-new-tokens 40
    nvg generate results/teacher.cmf "Who wrote Hamlet?" --chat --temperature 0.7 --seed 1

`--chat` wraps the prompt as one user message in the model's chat template (from the CMF header).
The prompt runs once and fills a static KV cache; each new token is then one cached step (tokens/s is
printed). Meant for looking at a model, not serving it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from nvg.cmf import read_cmf
from nvg.errors import exits_cleanly
from nvg.model import autocast, load_model, pick_device
from nvg.sources import ChatRenderer
from nvg.tokenizer import cmf_tokenizer


@torch.no_grad()
def generate(model, prompt_ids: list[int], max_new_tokens: int, temperature: float, stop_ids: set[int],
             seed: int, device) -> list[int]:
    """New token ids after `prompt_ids`: argmax when temperature is 0, else softmax(logits / temperature)
    samples. The prompt runs once and fills the KV cache; every new token is then one cached step."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    limit = min(model.cfg.max_position_embeddings, len(prompt_ids) + max_new_tokens)
    if len(prompt_ids) >= limit:
        return []
    model.setup_cache(1, limit, torch.bfloat16 if device.type == "cuda" else torch.float32)
    ids, step = list(prompt_ids), torch.tensor([prompt_ids], device=device)
    pos = torch.arange(len(prompt_ids), device=device)
    while len(ids) < limit:
        with autocast(device, "bf16"):
            h = model.decode(step, pos)[:, -1]
            logits = (h @ model.logits_head().to(h.dtype).T).float().cpu()[0]  # a frozen head cast once, not per token
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            nxt = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen))
        ids.append(nxt)
        if nxt in stop_ids:
            break
        step, pos = torch.tensor([[nxt]], device=device), torch.tensor([len(ids) - 1], device=device)
    return ids[len(prompt_ids):]


def prompt_ids(cmf, tokenizer, prompt: str, chat: bool) -> list[int]:
    """The prompt's token ids; with `chat`, one user message rendered with the model's template."""
    if chat:
        prompt = ChatRenderer(cmf, cmf.path)([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tokenizer.encode(prompt, add_special_tokens=False).ids


def main(source: Path, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, chat: bool = False,
         seed: int = 0, device: str = "auto") -> str:
    cmf = read_cmf(source)
    tok = cmf_tokenizer(cmf, source, "generate with")
    tok_cfg = cmf.header.get("tokenizer_config", {})
    dev = pick_device(device)
    model = load_model(cmf, dev)
    t0 = time.perf_counter()
    new = generate(model, prompt_ids(cmf, tok, prompt, chat), max_new_tokens, temperature,
                   set(tok_cfg.get("eos_token_ids", [])), seed, dev)
    seconds = time.perf_counter() - t0
    print(f"nvg generate: {len(new)} new tokens in {seconds:.2f} s ({len(new) / max(seconds, 1e-9):.1f} tok/s) on {dev}",
          file=sys.stderr)
    return tok.decode(new, skip_special_tokens=True)


@exits_cleanly
def cli(argv=None):
    ap = argparse.ArgumentParser(prog="nvg generate", description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path, help="any CMF (student or teacher)")
    ap.add_argument("prompt", help="the text to continue (or, with --chat, the user's message)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="at most this many new tokens (default 64)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    ap.add_argument("--chat", action="store_true", help="apply the model's chat template; print the reply alone")
    ap.add_argument("--seed", type=int, default=0, help="of the sampling (default 0)")
    ap.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    a = ap.parse_args(argv)
    out = main(a.file, a.prompt, a.max_new_tokens, a.temperature, a.chat, a.seed, a.device)
    sys.stdout.write(("" if a.chat else a.prompt) + out + "\n")  # a plain prompt is echoed, its continuation follows


if __name__ == "__main__":
    cli()
