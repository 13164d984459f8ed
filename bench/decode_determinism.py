"""generate_corpus's promise on a GPU, on the real teacher: one seed samples the same tokens. Session 17 found it
broken (docs/reliability.md): two corpora from one seed agreed up to position 64 and diverged after it. This
samples one batch twice from one seed with each attention for the decoder's cached step: nvg's (two GEMMs and
a float32 softmax, since session 18), the fused SDPA it replaced, and SDPA held to its memory-efficient kernel;
for each it writes how many sequences agree, the first differing position, the second run's tokens/s
(compiled and warm) and the first run's digest (run the script twice to compare across processes), one JSON
line per variant as soon as it is measured.
    python bench/decode_determinism.py --teacher results/teacher.cmf --out "$OUT/decode_determinism.jsonl" """

import argparse
import hashlib
import json
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import nvg.model
from nvg.decoding import Decoder
from nvg.generate_corpus import CorpusSettings, sample_sequences


def fused_attention(q, k, v, pos):
    """What the decoder did before session 18: torch's fused SDPA with the cache's mask and native GQA."""
    visible = torch.arange(k.shape[2], device=pos.device)[None, :] <= pos[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)


def efficient_attention(q, k, v, pos):
    """SDPA held to its memory-efficient kernel (no cuDNN, no math), K/V repeated per query head (that kernel
    may not take enable_gqa)."""
    visible = torch.arange(k.shape[2], device=pos.device)[None, :] <= pos[:, None]
    group = q.shape[1] // k.shape[1]
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                              attn_mask=visible)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--length", type=int, default=320, help="past 256, so two KV buckets and well past 64")
    ap.add_argument("--device", default="cuda", help="cpu runs eagerly: a check of this script, not of the promise")
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="nvg,sdpa,efficient", help="which of nvg, sdpa, efficient, in order")
    args = ap.parse_args()
    dev = torch.device(args.device)
    settings = CorpusSettings(sequences=args.batch, length=args.length, shards=1, first_token="vocab",
                              greedy_prefix=4, temperature=1.0, top_k=0, top_p=1.0, batch=args.batch,
                              seed=1234, device=args.device, precision="bf16")
    firsts = np.arange(args.batch, dtype=np.int64) * 37 + 100
    variants = {"nvg": ("two GEMMs and a softmax (nvg.model.cached_attention)", nvg.model.cached_attention),
                "sdpa": ("torch SDPA with the mask (nvg before session 18)", fused_attention),
                "efficient": ("SDPA held to its memory-efficient kernel", efficient_attention)}
    as_it_is = nvg.model.cached_attention
    for name, attention in (variants[key] for key in args.variants.split(",")):
        nvg.model.cached_attention = attention
        torch._dynamo.reset()
        row = {"variant": name, "torch": torch.__version__, "sequences": args.batch, "length": args.length,
               "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}
        try:
            decoder = Decoder(nvg.model.load_model(args.teacher, dev), args.batch, args.length, dev, "bf16")
            runs, seconds = [], []
            for _ in range(2):
                torch.manual_seed(1234)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                runs.append(sample_sequences(decoder, firsts, settings, name))
                seconds.append(time.perf_counter() - t0)
            differ = (runs[0] != runs[1]).any(0)
            row |= {"identical_sequences": int((runs[0] == runs[1]).all(1).sum()),
                    "first_differing_position": int(differ.argmax()) if differ.any() else None,
                    "tok_s_warm": round(args.batch * args.length / seconds[1]), "seconds_first_run": round(seconds[0], 1),
                    # the same digest from two processes (run the script twice) is the promise across runs
                    "digest_first_run": hashlib.blake2b(runs[0].tobytes(), digest_size=8).hexdigest()}
            del decoder
        except RuntimeError as e:  # a candidate that does not compile is a result too; the others still run
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    nvg.model.cached_attention = as_it_is


if __name__ == "__main__":
    main()
