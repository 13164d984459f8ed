"""Which fast path pays: variants of the teacher pass and the distillation step on a random SmolLM2-shaped model.

    python bench/speed_study.py OUT.json
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import numpy as np
import torch
import torch.nn.functional as F

from nvg import losses
from nvg.model import Block, BlrLinear, ModelConfig, build_model, parse_body_linear

sys.path.insert(0, "bench")
from gpu_bench import random_blr  # noqa: E402

SMOL = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                   head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)
W = 2048
dev = torch.device("cuda")
out: dict = {}


def timed(fn, iters):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def record(name, fn, tokens, iters=5):
    try:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        s = timed(fn, iters)
        out[name] = {"tok_s": round(tokens / s), "ms": round(s * 1e3, 2), "peak_GB": round(torch.cuda.max_memory_allocated() / 1e9, 2),
                     "first_s": round(first, 1)}
    except Exception as e:  # noqa: BLE001
        out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        traceback.print_exc()
    print(name, out[name], flush=True)


def dense_model():
    g = torch.Generator().manual_seed(0)
    c = SMOL

    def get(name):
        if name.endswith("bias") or "q_norm" in name or "k_norm" in name or name == "lm_head.weight":
            return None
        if name.endswith("norm.weight"):
            return torch.ones(c.hidden_size)
        if name == "model.embed_tokens.weight":
            return torch.randn(c.vocab_size, c.hidden_size, generator=g) * 0.05
        lr = parse_body_linear(name)
        o, i = {"q": (576, 576), "k": (192, 576), "v": (192, 576), "o": (576, 576), "gate": (1536, 576), "up": (1536, 576),
                "down": (576, 1536)}[lr[1]]
        return torch.randn(o, i, generator=g) / i ** 0.5

    return build_model(c, get)


def fold_forward(self, x):
    dt = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    p, r = self.ell.shape
    a = (self.sv * (self.ell[:, :, None] * self.g[:, None, :])).to(dt).reshape(p * r, -1)
    b = (self.su * self.h[:, :, None]).to(dt).permute(1, 0, 2).reshape(self.h.shape[1], p * r)
    return F.linear(F.linear(x, a), b)


def two_stage_topk(z, k, block=128):
    n, v = z.shape
    zb = z.view(n, v // block, block)
    _, bidx = zb.amax(-1).topk(k, -1)
    cand = zb.gather(1, bidx[..., None].expand(-1, -1, block)).view(n, -1)
    vals, j = cand.topk(k, -1)
    return vals, bidx.gather(1, j // block) * block + j % block


def main():
    out["torch"], out["gpu"] = torch.__version__, torch.cuda.get_device_name()
    teacher = dense_model().to(dev, torch.bfloat16).eval()
    head = teacher.head_weight
    B = 32
    x = torch.randint(0, SMOL.vocab_size, (B, W), device=dev)
    # --- components of the teacher pass
    with torch.no_grad():
        record("T body eager", lambda: teacher.hidden(x), B * W)
        h = teacher.hidden(x)
        hf = h.reshape(-1, 576)
        ch = hf[:4096]
        record("T head chunk matmul", lambda: F.linear(ch, head), 4096, 20)
        z = F.linear(ch, head)
        zf = z.float()
        record("T head chunk float lse", lambda: torch.logsumexp(z.float(), -1), 4096, 20)
        record("T head chunk topk fp32", lambda: zf.topk(64, -1), 4096, 20)
        record("T head chunk topk bf16", lambda: z.topk(64, -1), 4096, 20)
        record("T head chunk two-stage fp32", lambda: two_stage_topk(zf, 64), 4096, 20)
        record("T head chunk two-stage bf16", lambda: two_stage_topk(z, 64), 4096, 20)
        a1, i1 = zf.topk(64, -1)
        a2, i2 = two_stage_topk(zf, 64)
        out["two_stage_equal_vals"] = bool(torch.equal(a1, a2))
        record("T head all eager", lambda: losses.topk_logprobs(h, head, 64), B * W)

        @torch.compile(dynamic=False)
        def head_chunk(hc):
            z = F.linear(hc, head)
            lse = torch.logsumexp(z.float(), -1, keepdim=True)
            vals, idx = two_stage_topk(z, 64)
            return idx.int(), vals.float() - lse

        def head_all():
            return [head_chunk(hf[s:s + 4096]) for s in range(0, hf.shape[0], 4096)]

        record("T head compiled two-stage bf16", head_all, B * W)
        record("T pass eager", lambda: losses.topk_logprobs(teacher.hidden(x), head, 64), B * W)
        for layer in teacher.model.layers:
            layer.compile()
        record("T body regional compile", lambda: teacher.hidden(x), B * W)
        record("T pass regional + compiled head", lambda: [head_chunk(c) for c in teacher.hidden(x).reshape(-1, 576).split(4096)], B * W)
    del teacher, h, hf, z, zf
    # --- the distillation step
    dense = {n: p.detach().float().cpu() for n, p in dense_model().state_dict().items()}
    rng = np.random.default_rng(0)

    def make_student():
        s = build_model(SMOL, lambda n: (random_blr(*dense[n].shape, 1.0, rng) if n in dense and parse_body_linear(n) else dense.get(n)))
        s = s.to(dev)
        for n, p in s.named_parameters():
            p.requires_grad_(n.endswith((".h", ".ell", ".g")) or n.endswith("norm.weight"))
        return s

    Bs = 16
    xs = torch.randint(0, SMOL.vocab_size, (Bs, W), device=dev)
    t_ids = torch.randint(0, SMOL.vocab_size, (Bs, W, 64), device=dev, dtype=torch.int32)
    t_logp = torch.log_softmax(torch.randn(Bs, W, 64, device=dev), -1).half()

    def stepper(student, ckpt=False, kl=losses.topk_kl):
        params = [p for p in student.parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=1e-4, fused=True)
        if ckpt:
            for layer in student.model.layers:
                layer._fwd = layer.forward
                layer.forward = (lambda l: lambda *a: torch.utils.checkpoint.checkpoint(l._fwd, *a, use_reentrant=False))(layer)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = kl(student.hidden(xs), student.head_weight, t_ids, t_logp) / xs.numel()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    st = make_student()
    record("S eager current", stepper(st), Bs * W, 3)
    for layer in st.model.layers:
        layer.compile()
    record("S regional compile current", stepper(st), Bs * W, 3)
    del st
    BlrLinear.forward = fold_forward
    st = make_student()
    record("S eager fold", stepper(st), Bs * W, 3)
    for layer in st.model.layers:
        layer.compile()
    record("S regional compile fold", stepper(st), Bs * W, 3)
    ckl = torch.compile(losses._kl_block, dynamic=False)

    def kl_compiled(hidden, head, ids, lp, tail=False, chunk=4096):
        h = hidden.reshape(-1, hidden.shape[-1])
        ids, lp = ids.reshape(-1, 64), lp.reshape(-1, 64)
        total = 0
        for s in range(0, h.shape[0], chunk):
            total = total + torch.utils.checkpoint.checkpoint(ckl, h[s:s + chunk], head, ids[s:s + chunk], lp[s:s + chunk], tail, use_reentrant=False)
        return total

    record("S regional compile fold + compiled kl", stepper(st, kl=kl_compiled), Bs * W, 3)
    del st
    st = make_student()
    for layer in st.model.layers:
        layer.compile()
    record("S regional compile fold + ckpt + compiled kl", stepper(st, ckpt=True, kl=kl_compiled), Bs * W, 3)
    # forward-only student (eval)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        record("S fwd only fold compiled", lambda: st.hidden(xs), Bs * W)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    record("bf16 mm 8192", lambda: a @ a, 2 * 8192 ** 3 / 1e6, 10)  # 'tok_s' here is TFLOP/s × 1e6


if __name__ == "__main__":
    try:
        main()
    finally:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)
