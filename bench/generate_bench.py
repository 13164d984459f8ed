"""Sampling speed: nvg's generate_corpus decoder against plain transformers `generate`, same weights,
same batch and length, in one process on one GPU (the device run for docs/benchmarks.md).

    python bench/generate_bench.py --teacher results/teacher.cmf --batch 512 --length 256 --out gen.json

nvg: the stage's own decoding loop (`generate_corpus.sample_sequences`: static KV cache, the step compiled
and replayed as a CUDA graph), timed on a second call so the compile is reported apart; both sides
exclude loading the model. transformers: bf16, sdpa,
`generate(do_sample=True, temperature=1, top_k=0)` from the same first tokens, exactly `length` tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import hf_model  # noqa: E402  (the same transformers twin the step benchmark uses)

from nvg import generate_corpus  # noqa: E402
from nvg.cmf import read_cmf  # noqa: E402
from nvg.decoding import Decoder  # noqa: E402
from nvg.model import load_model  # noqa: E402
from nvg.settings import load  # noqa: E402
from nvg.tokenizer import cmf_tokenizer  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    s = load(generate_corpus.CorpusSettings, sequences=a.batch, length=a.length, batch=a.batch, device="cuda")
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers_version": transformers.__version__,
           "batch": a.batch, "length": a.length, "date": time.strftime("%Y-%m-%d")}
    cmf = read_cmf(a.teacher)
    firsts = generate_corpus.first_tokens(cmf_tokenizer(cmf, a.teacher, "pick first tokens with"), cmf.arch["vocab_size"], s)
    decoder = Decoder(load_model(cmf, "cuda"), a.batch, a.length, torch.device("cuda"), s.precision)
    times = []
    for _ in range(2):  # the first call includes the compile and the graph captures
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        generate_corpus.sample_sequences(decoder, firsts[:, None], [], s, "nvg")  # no chat opening
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del decoder
    tokens = a.batch * a.length
    out["nvg"] = {"first_call_s": times[0], "s": times[1], "tok_s": tokens / times[1]}
    teacher = load_model(a.teacher, "cuda")
    state = {n: p.detach().to(torch.bfloat16) for n, p in teacher.state_dict().items()}
    hf = hf_model(teacher.cfg, state)
    del teacher
    firsts = torch.from_numpy(firsts).cuda()
    hf_times = []
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            seq = hf.generate(input_ids=firsts[:, None], attention_mask=torch.ones_like(firsts[:, None]), do_sample=True,
                              temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=a.length - 1,
                              min_new_tokens=a.length - 1, pad_token_id=0)
        torch.cuda.synchronize()
        hf_times.append(time.perf_counter() - t0)
    assert seq.shape == (a.batch, a.length), seq.shape
    out["transformers"] = {"first_call_s": hf_times[0], "s": hf_times[1], "tok_s": tokens / hf_times[1]}
    out["speedup"] = out["nvg"]["tok_s"] / out["transformers"]["tok_s"]
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
