"""nvg's side of the GPU benchmark (docs/benchmarks.md): run in the same call as ../shared/tools/hf_baseline.py.

1. teacher pass: nvg's teacher_topk path (bf16 model, chunked LM head + log-softmax + top-64), tokens/s and peak memory
2. distillation step: nvg's train_student path on a BLR student at 1 bpw (P = 2, rank from the budget),
   KL to cached top-64 in chunks, Adam on h, ℓ, g and norm gains; tokens/s and peak memory
3. model FLOP utilisation of both against the measured bf16 matmul rate

    python bench/gpu_bench.py TEACHER.cmf OUT.json [--compile]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from nvg import blr as codec
from nvg.cmf import read_cmf
from nvg.losses import topk_kl, topk_logprobs
from nvg.model import ModelConfig, build_model, flops_per_token, load_model, parse_body_linear
from nvg.train_student import trainable

WINDOW = 2048


def timed(fn, iters):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def random_blr(d_out, d_in, bpw, rng):
    r = codec.max_rank(bpw, 2, d_out, d_in)
    return codec.BlrTensor.from_factors([
        (rng.uniform(0.5, 1.5, d_out) * 0.05, rng.uniform(0.5, 1.5, d_in), rng.uniform(0.5, 1.5, r) * 0.05,
         rng.choice([-1.0, 1.0], (d_out, r)), rng.choice([-1.0, 1.0], (r, d_in))) for _ in range(2)])


def student_like(cfg: ModelConfig, dense_get, bpw: float):
    """The teacher's dense tensors with every body linear replaced by a BLR tensor at `bpw` (P = 2)."""
    rng = np.random.default_rng(0)

    def get(name):
        t = dense_get(name)
        if t is not None and parse_body_linear(name):
            return random_blr(t.shape[0], t.shape[1], bpw, rng)
        return t

    return build_model(cfg, get)


def blr_flops_per_token(model) -> float:
    """Forward matmul FLOPs per token of a BLR model: 2·P·r·(d_in + d_out) per linear, plus the LM head."""
    total = 0.0
    for lin in model.blr_linears().values():
        p, r = lin.h.shape[0], lin.rank
        total += 2 * p * r * (lin.h.shape[1] + lin.g.shape[1])
    return total + 2 * model.head_weight.numel()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("teacher")
    ap.add_argument("out")
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    dev = torch.device("cuda")
    out = {"model": a.teacher, "window": WINDOW, "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    cmf = read_cmf(a.teacher)
    cfg = ModelConfig.from_arch(cmf.arch)
    teacher = load_model(cmf, dev)
    dense = {n: p.detach().float().cpu() for n, p in teacher.state_dict().items()}
    teacher = teacher.to(torch.bfloat16).eval()
    fpt = flops_per_token(cfg) + 4 * cfg.num_layers * WINDOW / 2 * cfg.num_heads * cfg.head_dim  # + causal attention
    for B in (8, 32):
        x = torch.randint(0, cfg.vocab_size, (B, WINDOW), device=dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

        def teacher_pass():
            with torch.no_grad():
                return topk_logprobs(teacher.hidden(x), teacher.head_weight, 64)

        s = timed(teacher_pass, 5)
        out[f"teacher_topk_B{B}_tok_s"] = B * WINDOW / s
        out[f"teacher_topk_B{B}_peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
        out[f"teacher_topk_B{B}_TFLOPs"] = fpt * B * WINDOW / s / 1e12
    # the BLR student at 1 bpw
    student = student_like(cfg, lambda n: dense.get(n), 1.0)
    student = student.to(dev)
    student.model.embed_tokens.weight.data = student.model.embed_tokens.weight.data.to(torch.bfloat16)
    params = trainable(student)
    out["student_body_bpw"] = float(np.mean([codec.bits_per_weight(2, m.rank, m.h.shape[1], m.g.shape[1])
                                             for m in student.blr_linears().values()]))
    opt = torch.optim.Adam(list(params.values()), lr=1e-4, fused=True)
    sfpt = blr_flops_per_token(student) + 4 * cfg.num_layers * WINDOW / 2 * cfg.num_heads * cfg.head_dim
    hidden_fn = torch.compile(student.hidden) if a.compile else student.hidden
    for B in (8, 16):
        x = torch.randint(0, cfg.vocab_size, (B, WINDOW), device=dev)
        with torch.no_grad():
            t_ids, t_logp = topk_logprobs(teacher.hidden(x), teacher.head_weight, 64)
        t_logp = t_logp.half()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = topk_kl(hidden_fn(x), student.head_weight, t_ids, t_logp) / x.numel()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        s = timed(step, 3)
        out[f"distill_step_blr1bpw_B{B}_tok_s"] = B * WINDOW / s
        out[f"distill_step_blr1bpw_B{B}_peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
        out[f"distill_step_blr1bpw_B{B}_TFLOPs"] = 3 * sfpt * B * WINDOW / s / 1e12
    out["teacher_flops_per_token"] = fpt
    out["student_flops_per_token"] = sfpt
    print(json.dumps(out, indent=1))
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
