"""What the decoding step's compile costs on a GPU, cold, in the decoder as generate_corpus runs it (its blocks compiled,
the step captured as a CUDA graph per cache bucket; session 61), against the decoder before it (the whole step compiled
by inductor in one graph with its CUDA graphs: about 70 s of each corpus shard) and the candidate after it (the draw
compiled too: CompiledDrawDecoder). A random SmolLM2-135M-shaped model (compile time and step time depend
on the shapes, not the weights), `--batch` sequences of `--length` tokens, every decoder compiled from an empty inductor
cache in one process; one JSON line per decoder: the seconds of the first
step of each bucket (the first holds the compile; a recompile shows in a later one), the whole cold batch's
seconds, and the tokens/s of a second, warm batch.

    python bench/decode_compile.py --out "$OUT/decode_compile.jsonl"
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F

from gpu_bench import SMOLLM2_135M, hf_model
from nvg import decoding
from nvg.decoding import Decoder, sample
from nvg.model import autocast, build_model


class WholeStepDecoder(Decoder):
    """The baseline: the decoder before session 61, which compiled the whole step (every block, the head and the
    draw) as one inductor graph and let inductor capture it as a CUDA graph."""

    def __init__(self, model, batch, max_len, device, precision, temperature=1.0, top_k=0, top_p=1.0):
        self.model, self.device, self.precision = model, device, precision
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.batch, self.max_len = batch, max_len
        model.setup_cache(batch, max_len, torch.bfloat16)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.greedy = torch.zeros((), dtype=torch.bool, device=device)
        self.kv_positions = torch.arange(max_len, device=device)
        torch.compiler.reset()
        self.step = torch.compile(self._whole_step, fullgraph=True,
                                  options={**decoding.COMPILE_OPTIONS, "triton.cudagraphs": True})

    def _whole_step(self, ids, pos, greedy, kv_window):
        with autocast(self.device, self.precision):
            h = self.model.decode(ids[:, None], pos, kv_window)[:, -1]
            logits = F.linear(h, self.model.head_weight.to(h.dtype)).float()
        return torch.where(greedy, logits.argmax(-1), sample(logits, self.temperature, self.top_k, self.top_p))

    @torch.no_grad()
    def next_ids(self, ids, pos, greedy):
        self.pos.fill_(pos)
        self.greedy.fill_(greedy)
        kv_window = self.kv_positions[: min(self.max_len, (pos // decoding.KV_BUCKET + 1) * decoding.KV_BUCKET)]
        torch._dynamo.mark_dynamic(kv_window, 0)
        return self.step(ids, self.pos, self.greedy, kv_window).clone()


class CompiledDrawDecoder(Decoder):
    """The stage's decoder with its draw (`Decoder._draw`: the logits' float32 cast, the Gumbel noise, the argmax)
    compiled as a second region, so that it fuses into a few kernels inside the captured step instead of about eight
    eager passes over [batch, vocabulary] a step. The candidate to measure before it becomes the stage's (it draws
    another corpus from a seed: inductor's random numbers are not eager's)."""

    def __init__(self, model, batch, max_len, device, precision, temperature=1.0, top_k=0, top_p=1.0, backend=None):
        super().__init__(model, batch, max_len, device, precision, temperature, top_k, top_p, backend)
        backend = backend or "inductor"
        self._draw = torch.compile(self._draw, fullgraph=True, backend=backend,
                                   options=decoding.COMPILE_OPTIONS if backend == "inductor" else None)


DECODERS = {"nvg": Decoder, "compiled-draw": CompiledDrawDecoder, "whole-step": WholeStepDecoder}


def one_batch(decoder: Decoder, batch: int, length: int) -> tuple[float, dict]:
    """Seconds for one batch of `length` tokens, and the seconds of each bucket's first step, by its position."""
    torch.manual_seed(1234)
    tok = torch.arange(batch, device="cuda") + 5
    marks, start = {}, time.perf_counter()
    for pos in range(length - 1):
        if pos % decoding.KV_BUCKET == 0:
            torch.cuda.synchronize()
            marks[pos] = time.perf_counter() - start
        tok = decoder.next_ids(tok, pos, greedy=pos < 4)
        if pos % decoding.KV_BUCKET == 0:
            torch.cuda.synchronize()
            marks[pos] = round(time.perf_counter() - start - marks[pos], 2)  # this step's own seconds
    torch.cuda.synchronize()
    return time.perf_counter() - start, marks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--decoders", nargs="+", default=list(DECODERS), choices=list(DECODERS))
    a = ap.parse_args()
    torch.manual_seed(0)
    hf = hf_model(SMOLLM2_135M, None)
    dense = {n: p.detach().float().cpu() for n, p in hf.state_dict().items() if n != "lm_head.weight"}
    hf = None
    for name in a.decoders:
        model = build_model(SMOLLM2_135M, dense.get).cuda()  # its own: the nvg decoder compiles the model's blocks
        torch._dynamo.reset()
        with torch._inductor.config.patch(force_disable_caches=True):  # a cold compile, as on a fresh machine
            decoder = DECODERS[name](model, a.batch, a.length, torch.device("cuda"), "bf16", temperature=1.0)
            cold, marks = one_batch(decoder, a.batch, a.length)
            warm, _ = one_batch(decoder, a.batch, a.length)
        row = {"decoder": name, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": a.batch,
               "length": a.length, "kv_bucket": decoding.KV_BUCKET, "first_batch_s": round(cold, 1),
               "bucket_first_step_s": marks, "warm_batch_s": round(warm, 2),
               "warm_tok_s": round(a.batch * (a.length - 1) / warm)}
        print(json.dumps(row), flush=True)
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        decoder = model = None


if __name__ == "__main__":
    main()
