"""generate_corpus's promise on a GPU, on the real teacher, in one process: one seed samples the same tokens
twice. Session 17 found it broken (docs/reliability.md): two corpora from one seed agreed up to position 64
and diverged after it. This samples one batch twice from one seed with the decoder as it is, then with a
candidate for its cached attention (two GEMMs and a float32 softmax in place of the fused SDPA kernel, whose
key blocks are the suspect), then with SDPA held to its memory-efficient kernel, and writes, for each, how many sequences agree, the first differing position
and the second run's tokens/s (compiled and warm), one JSON line per variant as soon as it is measured.
    python bench/decode_determinism.py --teacher results/teacher.cmf --out "$OUT/decode_determinism.jsonl" """

import argparse
import json
import time
import types

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import nvg.model
from nvg.decoding import Decoder
from nvg.generate_corpus import CorpusSettings, sample_sequences


def gemm_attention(q, k, v, attn_mask=None, enable_gqa=False, **kw):
    """The candidate for the decoding branch (the one that passes a mask); everything else goes to SDPA.
    The query heads that share a K/V head are rows of one GEMM, so K/V are not repeated."""
    if attn_mask is None:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa, **kw)
    b, heads, t, d = q.shape
    group = heads // k.shape[1]
    scores = torch.matmul(q.reshape(b, k.shape[1], group * t, d) * d**-0.5, k.transpose(-1, -2))
    scores = scores.float().masked_fill(~attn_mask.repeat(group, 1), float("-inf"))
    return torch.matmul(scores.softmax(-1).to(v.dtype), v).reshape(b, heads, t, d)


def efficient_attention(q, k, v, attn_mask=None, enable_gqa=False, **kw):
    """The second candidate: SDPA held to its memory-efficient kernel (no cuDNN, no math), K/V repeated per
    query head (that kernel may not take enable_gqa)."""
    if attn_mask is None:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa, **kw)
    group = q.shape[1] // k.shape[1]
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                              attn_mask=attn_mask, **kw)


def with_attention(attention):
    """torch.nn.functional with scaled_dot_product_attention replaced, for nvg.model to call."""
    return types.SimpleNamespace(**{n: getattr(F, n) for n in dir(F) if not n.startswith("_")}
                                 | {"scaled_dot_product_attention": attention})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--length", type=int, default=320, help="past 256, so two KV buckets and well past 64")
    ap.add_argument("--device", default="cuda", help="cpu runs eagerly: a check of this script, not of the promise")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device(args.device)
    settings = CorpusSettings(sequences=args.batch, length=args.length, shards=1, first_token="vocab",
                              greedy_prefix=4, temperature=1.0, top_k=0, top_p=1.0, batch=args.batch,
                              seed=1234, device=args.device, precision="bf16")
    firsts = np.arange(args.batch, dtype=np.int64) * 37 + 100
    variants = {"torch SDPA (nvg as it is)": F, "two GEMMs and a softmax": with_attention(gemm_attention),
                "SDPA held to its memory-efficient kernel": with_attention(efficient_attention)}
    for name, functional in variants.items():
        nvg.model.F = functional
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
                    "tok_s_warm": round(args.batch * args.length / seconds[1]), "seconds_first_run": round(seconds[0], 1)}
            del decoder
        except RuntimeError as e:  # a candidate that does not compile is a result too; the others still run
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    nvg.model.F = F


if __name__ == "__main__":
    main()
