"""What the decoding step's compile costs on a GPU, cold, in the decoder as generate_corpus runs it, against the
step as it was before session 26 (the cache length passed as an int: dynamo compiled it as a constant for the
first KV bucket, then again as a symbol for the others). A random SmolLM2-135M-shaped model (compile time and
step time depend on the shapes, not the weights), `--batch` sequences of `--length` tokens, both decoders
compiled from an empty inductor cache in one process; one JSON line per decoder: the seconds of the first
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


class IntLengthDecoder(Decoder):
    """The baseline: the decoder before session 26, which gave its compiled step the cache length as an int."""

    def _step(self, ids, pos, greedy, kv_len: int):
        with autocast(self.device, self.precision):
            h = self.model.decode(ids[:, None], pos, kv_len)[:, -1]
            logits = F.linear(h, self.model.head_weight.to(h.dtype)).float()
        return torch.where(greedy, logits.argmax(-1), sample(logits, self.temperature, self.top_k, self.top_p))

    @torch.no_grad()
    def next_ids(self, ids, pos, greedy):
        self.pos.fill_(pos)
        self.greedy.fill_(greedy)
        kv_len = min(self.max_len, (pos // decoding.KV_BUCKET + 1) * decoding.KV_BUCKET)
        return self.step(ids, self.pos, self.greedy, kv_len).clone()


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
    ap.add_argument("--decoders", nargs="+", default=["nvg", "int-length"], choices=["nvg", "int-length"])
    a = ap.parse_args()
    torch.manual_seed(0)
    hf = hf_model(SMOLLM2_135M, None)
    dense = {n: p.detach().float().cpu() for n, p in hf.state_dict().items() if n != "lm_head.weight"}
    hf = None
    model = build_model(SMOLLM2_135M, dense.get).cuda()
    for name in a.decoders:
        torch._dynamo.reset()
        with torch._inductor.config.patch(force_disable_caches=True):  # a cold compile, as on a fresh machine
            cls = Decoder if name == "nvg" else IntLengthDecoder
            decoder = cls(model, a.batch, a.length, torch.device("cuda"), "bf16", temperature=1.0)
            cold, marks = one_batch(decoder, a.batch, a.length)
            warm, _ = one_batch(decoder, a.batch, a.length)
        row = {"decoder": name, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": a.batch,
               "length": a.length, "kv_bucket": decoding.KV_BUCKET, "first_batch_s": round(cold, 1),
               "bucket_first_step_s": marks, "warm_batch_s": round(warm, 2),
               "warm_tok_s": round(a.batch * (a.length - 1) / warm)}
        print(json.dumps(row), flush=True)
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        decoder = None


if __name__ == "__main__":
    main()
