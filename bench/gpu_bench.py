"""GPU benchmark (docs/benchmarks.md): nvg and plain transformers side by side, in one process, one GPU.

For each model, the real SmolLM2-135M (a teacher CMF) and a random Llama-3.2-1B-shaped model, on
2048-token windows in bf16:

1. teacher pass, tokens/s and peak memory of forward + log-softmax + top-64.
   nvg: teacher_topk's path (compiled blocks; LM head, log-sum-exp and two-stage top-k in compiled
   4096-token blocks). Baseline: `model(x).logits`, float32 softmax, topk, as in
   ../shared/tools/hf_baseline.py.
2. distillation step, tokens/s and peak memory. nvg: `Distiller.step` (nvg/distill.py) (the pipeline's
   step: batch from host arrays, bf16 autocast, compiled checkpointed blocks, chunked KL to the
   cached top-64, gradient norm and clip, train_student's Adam on h, ℓ, g and the norm gains, a group each:
   `student_adam`) on a BLR student at 1 bpw (P = 2). Baseline: the dense student, full float32 logits, log-softmax, gather, KL, Adam on
   every weight, as in hf_baseline.py.
3. model FLOP utilisation of both against the bf16 matmul rate measured in the same run (forward
   FLOPs, ×3 for a training step; causal attention counted; recomputation not counted).

    python bench/gpu_bench.py --teacher teacher.cmf --out bench.json
    python bench/gpu_bench.py --modes --out modes.json      # the distillation step alone, in each training mode of
                                                            # train_student (random weights), beside the dense
                                                            # transformers one, with MFU (--profile: and where each
                                                            # mode's time goes); --shapes SmolLM2-135M
                                                            # Llama-3.2-1B-shaped --batch 16 8: both shapes;
                                                            # --plan-log LOG: a pipeline's mixed plan;
                                                            # --compile-mode reduce-overhead: CUDA graphs;
                                                            # --graph-per-signature: a dynamo cache each
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import time
import types

import numpy as np
import torch
import triton
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from nvg import blr as codec
from nvg import fp8, tiled
from nvg.cmf import Q2TP, Tensor
from nvg.losses import topk_logprobs
from nvg.adam import OnePassAdam
from nvg.atomic import write_json
from nvg.distill import Distiller, Targets, param_groups
from nvg.layout import BODY_ROLES, parse_body_linear
from nvg.distributed import Group
from nvg.model import ModelConfig, build_model, compile_blocks, flops_per_token, group_scaled, load_model
from nvg.settings import load
from nvg import fused_sign_step
from nvg.sign_training import SignSettings, SignTrainer

WINDOW = 2048
SMOLLM2_135M = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                           num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                           max_position_embeddings=8192, tie_word_embeddings=True)
LLAMA_1B = ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                       num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
                       max_position_embeddings=131072, tie_word_embeddings=True)


def timed(fn, iters: int, windows: int = 1) -> float:
    """Seconds per call: the median over `windows` timed windows of `iters` calls each, after a warm-up."""
    fn()  # warm-up (and compilation)
    per_call = []
    for _ in range(windows):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        per_call.append((time.perf_counter() - t) / iters)
    return float(np.median(per_call))


def measure(fn, tokens: int, flops_per_tok: float, iters: int, windows: int = 1, held: int = 0) -> dict:
    """Tokens per second (the median window), peak memory (less `held` bytes that earlier rows keep) and TFLOP/s."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        s = timed(fn, iters, windows)
    except torch.OutOfMemoryError:
        return {"error": "out of memory"}
    return {"tok_s": round(tokens / s), "peak_GB": round((torch.cuda.max_memory_allocated() - held) / 1e9, 2),
            "TFLOP_s": round(flops_per_tok * tokens / s / 1e12, 1)}


def interleaved(steps: dict, setups: dict, iters: int, windows: int) -> dict[str, float]:
    """Seconds per call of each of `steps`, the median over `windows` rounds in which each runs `iters` calls in
    turn (after its `setups` entry): the machine's drift falls on all of them alike. Session 32 saw one mode move
    31 % between two runs and the cached top-k step run 25 % below its rate of earlier sessions, while the
    GPU-bound dense step did not move: on host-bound steps one timed row after another compares machines' moods."""
    per_call: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(windows):
        for name, step in steps.items():
            setups[name]()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(iters):
                step()
            torch.cuda.synchronize()
            per_call[name].append((time.perf_counter() - t) / iters)
    return {name: float(np.median(v)) for name, v in per_call.items()}


def attention_flops(cfg: ModelConfig) -> float:
    """Causal attention per token, forward: QKᵀ and PV over half the window on average."""
    return 4.0 * cfg.num_layers * (WINDOW / 2) * cfg.num_heads * cfg.head_dim


def blr_flops_per_token(model) -> float:
    """Forward matmul FLOPs per token of a BLR model: 2·P·r·(d_in + d_out) per linear, plus the LM head."""
    total = sum(2 * m.h.shape[0] * m.rank * (m.h.shape[1] + m.g.shape[1]) for m in model.blr_linears().values())
    return total + 2 * model.head_weight.numel()


class InMemoryTopk:
    """Targets for the distillation step made in memory here, read as `nvg.artifacts.TopkReader` is."""

    def __init__(self, ids: np.ndarray, logp: np.ndarray):
        self.ids, self.logp, self.k = ids, logp, ids.shape[-1]

    def read(self, rows):
        return self.ids[rows], self.logp[rows]


def hf_model(cfg: ModelConfig, state: dict | None, device: str = "cuda") -> LlamaForCausalLM:
    """The plain-transformers twin of a model: the same config, the same weights (random when `state` is None)."""
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                         num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                         rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
                         tie_word_embeddings=cfg.tie_word_embeddings, attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM(hf_cfg).to(torch.bfloat16)
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise SystemExit(f"weights do not fit the transformers model: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
    return model.eval()


def random_blr(d_out: int, d_in: int, paths: int, rank: int, rng) -> codec.BlrTensor:
    return codec.BlrTensor.from_factors([
        (rng.uniform(0.5, 1.5, d_out) * 0.05, rng.uniform(0.5, 1.5, d_in), rng.uniform(0.5, 1.5, rank) * 0.05,
         rng.choice([-1.0, 1.0], (d_out, rank)), rng.choice([-1.0, 1.0], (rank, d_in))) for _ in range(paths)])


def blr_student(cfg: ModelConfig, dense: dict, bpw: float, plan: dict[str, tuple[int, int]] | None = None):
    """The teacher's tensors with every body linear replaced by a random BLR tensor: at `bpw` with P = 2, or with
    the paths and rank `plan` gives it (a pipeline's mixed plan, `read_plan`)."""
    rng = np.random.default_rng(0)

    def tensor(n):
        if n not in dense or not parse_body_linear(n):
            return dense.get(n)
        paths, rank = plan[n] if plan else (2, codec.max_rank(bpw, 2, *dense[n].shape))
        return random_blr(*dense[n].shape, paths, rank, rng)
    return build_model(cfg, tensor)


PLAN_LINE = re.compile(r"^\s+(model\.layers\.\d+\.\S+\.weight): P=(\d+) r=(\d+) ")


def graph_per_signature(model):
    """Each block signature's layers get a `forward` of their own code object (a subclass of Block each), so dynamo
    keeps a cache for each signature instead of one for every graph of `Block.forward`: a mixed plan's eleven signatures
    make about 40 graphs there, whose guards a block call may check one after another (a guess for the 0.55-bpw run's
    slower host-bound steps, session 46, that bench/guard_cost.py found worth a few per cent at most on the CPU)."""
    block = type(model.model.layers[0])
    code, classes = block.forward.__code__, {}
    for layer in model.model.layers:
        sig = tuple(p.shape for p in layer.parameters())
        if sig not in classes:
            i = len(classes)
            forward = types.FunctionType(code.replace(co_name=f"forward_signature_{i}"), block.forward.__globals__,
                                         f"forward_signature_{i}", block.forward.__defaults__)
            classes[sig] = type(f"{block.__name__}Signature{i}", (block,), {"forward": forward})
        layer.__class__ = classes[sig]
    return model


def read_plan(log: str, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Every body linear's paths and rank as a pipeline's budget_reencode log states them (`name: P=2 r=96 …`
    lines): the bench's student then has that run's shapes, e.g. the 0.55-bpw recipe's mixed plan, whose steps
    took 0.30-0.35 s on an H100 where the 1.0-bpw plan's took 0.23-0.25 (docs/quality.md, session 46)."""
    plan = {m[1]: (int(m[2]), int(m[3])) for m in map(PLAN_LINE.match, open(log)) if m}
    expected = {f"model.layers.{i}.{suffix}.weight" for i in range(cfg.num_layers) for suffix in BODY_ROLES.values()}
    if set(plan) != expected:
        raise SystemExit(f"{log}: --plan-log: it names {len(plan)} body linears, {len(set(plan) & expected)} of them "
                         f"among this shape's {len(expected)}: not a plan for this shape")
    return plan


def baseline_teacher_pass(model, x):
    with torch.no_grad():
        logits = model(x).logits
        p = torch.softmax(logits.float(), -1)
        return torch.topk(p, 64, dim=-1)


def baseline_step(student, opt, x, t_ids, t_p):
    ls = torch.log_softmax(student(x).logits.float(), -1)
    lq = ls.gather(-1, t_ids)
    loss = (t_p * (t_p.clamp_min(1e-20).log() - lq)).sum(-1).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def student_adam(params: dict, kind: str = "one-pass"):
    """The student step's Adam. `one-pass`: train_student's (`OnePassAdam`, a group a tensor as `train.lr_relative`
    makes them); `torch-groups`: torch's fused Adam on those groups (train_student's before session 48);
    `torch-one-group`: torch's fused Adam on one group (this bench's before session 48, which left the pipeline's
    692 groups out of the step it timed)."""
    if kind == "torch-one-group":
        return torch.optim.Adam(list(params.values()), lr=1e-4, fused=True)
    groups = param_groups(params, relative=True)
    return OnePassAdam(groups, lr=1e-4) if kind == "one-pass" else torch.optim.Adam(groups, lr=1e-4, fused=True)


def bench_model(name: str, cfg: ModelConfig, teacher, teacher_batches, step_batches, iters: int,
                keep_activations: bool = False) -> dict:
    """`teacher`: nvg's float32 teacher on the GPU. Returns this model's rows."""
    rows: dict = {}
    say = lambda: print(name, json.dumps(rows), flush=True)  # noqa: E731
    fpt = flops_per_token(cfg) + attention_flops(cfg)
    dense = {n: p.detach().float().cpu() for n, p in teacher.state_dict().items()}
    # teacher pass: nvg (teacher_topk's model preparation and LM-head function)
    nvg_teacher = compile_blocks(teacher.to(torch.bfloat16).eval())
    for b in teacher_batches:
        x = torch.randint(0, cfg.vocab_size, (b, WINDOW), device="cuda")

        def nvg_pass():
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                return topk_logprobs(nvg_teacher.hidden(x), nvg_teacher.head_weight, 64)

        rows[f"teacher pass, batch {b}: nvg"] = measure(nvg_pass, b * WINDOW, fpt, iters)
        say()
    # the distillation targets of both sides, from the same teacher; then the teacher leaves the GPU
    targets = {}
    for b in step_batches:
        tokens = np.random.default_rng(b).integers(0, cfg.vocab_size, (b, WINDOW), dtype=np.int64)
        x = torch.from_numpy(tokens).cuda()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            t_ids, t_logp = topk_logprobs(nvg_teacher.hidden(x), nvg_teacher.head_weight, 64)
            t_p, t_full_ids = torch.topk(torch.softmax(nvg_teacher(x).float(), -1), 64, dim=-1)
        targets[b] = (tokens, t_ids.cpu().numpy(), t_logp.half().cpu().numpy(), x, t_full_ids, t_p / t_p.sum(-1, keepdim=True))
    nvg_teacher.to("cpu")
    # plain transformers with the same weights: teacher pass, then the dense distillation step
    hf = hf_model(cfg, {n: t.to(torch.bfloat16) for n, t in dense.items()})
    for b in teacher_batches:
        x = torch.randint(0, cfg.vocab_size, (b, WINDOW), device="cuda")
        rows[f"teacher pass, batch {b}: transformers"] = measure(lambda: baseline_teacher_pass(hf, x), b * WINDOW, fpt, iters)
        say()
    hf.train()
    opt = torch.optim.Adam(hf.parameters(), lr=1e-5)
    for b in step_batches:
        _, _, _, x, t_ids, t_p = targets[b]
        rows[f"distillation step, batch {b}: transformers (dense)"] = measure(
            lambda: baseline_step(hf, opt, x, t_ids, t_p), b * WINDOW, 3 * fpt, max(2, iters // 2))
        say()
    hf = opt = None  # frees the dense model before the student is measured
    targets = {b: Targets(t[0], b, "bench", InMemoryTopk(t[1], t[2])) for b, t in targets.items()}
    # nvg: a BLR student at 1 bpw through the pipeline's own step (nvg/distill.py)
    student = compile_blocks(blr_student(cfg, dense, 1.0).cuda())
    rows["student body bpw"] = round(float(np.mean([codec.bits_per_weight(2, m.rank, m.h.shape[1], m.g.shape[1])
                                                    for m in student.blr_linears().values()])), 3)
    sfpt = blr_flops_per_token(student) + attention_flops(cfg)
    for b in step_batches:
        d = Distiller(student, targets[b], torch.device("cuda"), batch=b, precision="bf16", recompute_every=1)
        opt = student_adam(d.params)
        rows[f"distillation step, batch {b}: nvg (BLR 1 bpw)"] = measure(
            lambda: d.step(list(range(b)), opt, 1.0, 1.0, lr=1e-3, clip=1.0), b * WINDOW, 3 * sfpt, max(2, iters // 2))
        say()
    if keep_activations:  # the other end of train.recompute_every: no block recomputed
        b = step_batches[-1]
        d = Distiller(student, targets[b], torch.device("cuda"), batch=b, precision="bf16", recompute_every=0)
        opt = student_adam(d.params)
        rows[f"distillation step, batch {b}: nvg (BLR 1 bpw), recompute_every 0"] = measure(
            lambda: d.step(list(range(b)), opt, 1.0, 1.0, lr=1e-3, clip=1.0), b * WINDOW, 3 * sfpt, max(2, iters // 2))
        say()
    rows["forward FLOPs per token"] = {"teacher": fpt, "BLR student": sfpt}
    return rows


def q2tp_embedding(model):
    """The model's tied embedding (and so its head) in q2tp, its group scales trainable, as load_model
    builds a student whose file has a q2tp embedding."""
    w = model.model.embed_tokens.weight.detach().float().cpu().numpy()
    group_scaled(model.model.embed_tokens, Tensor("model.embed_tokens.weight", Q2TP, w.shape, tiled.encode(w, 2)))
    return model


def profiled(fn, steps: int = 2) -> dict[str, str]:
    """torch.profiler's tables over `steps` calls (after the timed ones): the 20 ops with the most GPU time, each
    op's host time beside it, and the 20 with the most host time of their own (session 32: the steps are
    host-bound, the GPU busy 41-66 % of a step)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    ops = prof.key_averages()
    return {"gpu": ops.table(sort_by="cuda_time_total", row_limit=20), "host": ops.table(sort_by="self_cpu_time_total", row_limit=20)}


def step_modes(cfg: ModelConfig, batch: int, iters: int, windows: int, matmul_tflops: float, profile: bool = False,
               only: list[str] | None = None, plan: dict | None = None, compile_mode: str | None = None,
               per_signature: bool = False, adam: str = "one-pass", recompute_every: int = 1,
               progress=lambda rows: None) -> dict:
    """train_student's step in each training mode (docs/training.md) on a model of shape `cfg` (random
    weights, 1 bpw, P = 2), batch × WINDOW tokens, each beside the plain-transformers dense KD step: the
    cached top-64 (`targets: topk`), the live teacher (`targets: live`, full-vocabulary KL), the live teacher
    with sign training (`signs.enabled`), that with the per-layer hidden-state loss (`hidden_weight` 0.3: the
    README's GPU recipe's step from session 36), that with the f16 embedding and head trained too (`embedding_lr`:
    the README's GPU recipe's step since session 48; and that with `train.fp8`) and with a q2tp embedding and head; the
    cached top-64's step with `train.fp8` too. `only`: those modes alone (the
    dense step always). MFU: model FLOPs (forward ×3) per second over the bf16 matmul rate measured in the same run.
    `plan`: the student's paths and ranks from a pipeline's log (`read_plan`) instead of 1 bpw, P = 2. `compile_mode`:
    torch.compile's mode for the student's blocks (e.g. reduce-overhead: CUDA graphs, for the host-bound sign modes).
    `per_signature`: each block signature's graphs in a dynamo cache of their own (`graph_per_signature`). `adam`: the
    student's optimizer (`student_adam`). `recompute_every`: train.recompute_every (1, the schema's default: each
    block's forward again in backward; 0 keeps every block's activations)."""
    torch.manual_seed(0)
    big = hf_model(cfg, None)
    dense = {n: p.detach().float().cpu() for n, p in big.state_dict().items() if n != "lm_head.weight"}
    fpt = flops_per_token(cfg) + attention_flops(cfg)
    tokens = np.random.default_rng(batch).integers(0, cfg.vocab_size, (batch, WINDOW), dtype=np.int64)
    x = torch.from_numpy(tokens).cuda()
    logp = torch.log_softmax(torch.randn(batch, WINDOW, 64, device="cuda"), -1)
    ids = torch.randint(0, cfg.vocab_size, (batch, WINDOW, 64), device="cuda")
    hf = big.train()
    opt = torch.optim.Adam(hf.parameters(), lr=1e-5)
    rows: dict = {"batch": batch, "transformers (dense)": measure(lambda: baseline_step(hf, opt, x, ids, logp.exp()),
                                                                 batch * WINDOW, 3 * fpt, iters, windows)}
    progress(rows)
    hf = opt = big = None
    if "TFLOP_s" in rows["transformers (dense)"]:
        rows["transformers (dense)"]["MFU"] = round(rows["transformers (dense)"]["TFLOP_s"] / matmul_tflops, 3)
    teacher = compile_blocks(build_model(cfg, dense.get).cuda()).requires_grad_(False)
    topk = Targets(tokens, batch, "bench", InMemoryTopk(ids.int().cpu().numpy(), logp.half().cpu().numpy()))
    live = Targets(tokens, batch, "bench")
    # signs: the sign settings over the schema's defaults (None: scales only); grad_clip 2 is the GPU recipe's.
    # The last sign row runs the factored sign step as tensor ops (what it was before nvg/fused_sign_step.py), beside
    # the fused Triton passes that CUDA runs: the kernels' gain, measured in one run.
    # (targets, teacher, sign settings, q2tp embedding, hidden_weight, the f16 embedding trained, train.fp8)
    modes = {"topk (scales)": (topk, None, None, False, 0.0, False, False),
             "topk (scales), fp8": (topk, None, None, False, 0.0, False, True),
             "live (scales)": (live, teacher, None, False, 0.0, False, False),
             "live + signs": (live, teacher, {}, False, 0.0, False, False),
             "live + signs, grad_clip 2": (live, teacher, {"grad_clip": 2.0}, False, 0.0, False, False),
             "live + signs, grad_clip 2, hidden 0.3": (live, teacher, {"grad_clip": 2.0}, False, 0.3, False, False),
             "live + signs, grad_clip 2, hidden 0.3, embedding trained": (live, teacher, {"grad_clip": 2.0}, False, 0.3, True, False),
             "live + signs, grad_clip 2, hidden 0.3, embedding trained, fp8": (live, teacher, {"grad_clip": 2.0}, False, 0.3, True, True),
             "live + signs, grad_clip 2, tensor-op sign step": (live, teacher, {"grad_clip": 2.0}, False, 0.0, False, False),
             "live, q2tp embedding": (live, teacher, None, True, 0.0, False, False)}
    unknown = set(only or ()) - set(modes)
    if unknown:
        raise SystemExit(f"--only: no mode {sorted(unknown)}; the modes are {list(modes)}")
    # the two grad_clip 2 sign rows (fused and tensor-op step), timed again window by window in turn: the fused
    # step's gain
    pair = ("live + signs, grad_clip 2", "live + signs, grad_clip 2, tensor-op sign step")
    paired = {}
    held = 0  # bytes the paired rows keep while the rows after them run: left out of those rows' peaks
    for name, (targets, t, signs, q2tp, hidden_weight, embedding, in_fp8) in modes.items():
        if only and name not in only:
            continue
        before = torch.cuda.memory_allocated()
        # fused_sign_step.triton None: latent_step keeps to its tensor ops
        fused_sign_step.triton = None if name.endswith("tensor-op sign step") else triton
        student = blr_student(cfg, dense, 1.0, plan)
        student = graph_per_signature(student) if per_signature else student
        for m in student.blr_linears().values():
            m.fp8 = in_fp8
        student = compile_blocks((q2tp_embedding(student) if q2tp else student).cuda(), compile_mode)
        sfpt = blr_flops_per_token(student) + attention_flops(cfg)
        # teacher_memo_bytes 0: the live teacher runs every step, as for the pipeline's thousands of windows (the
        # bench's 16 would otherwise be kept after the first step: session 37's rows without the hidden loss were)
        d = Distiller(student, targets, torch.device("cuda"), batch=batch, precision="bf16", recompute_every=recompute_every, teacher=t,
                      hidden_weight=hidden_weight, teacher_memo_bytes=0, train_dense_vocab=embedding)
        if signs is not None:
            d.modes.append(SignTrainer(d.model.blr_linears(), load(SignSettings, enabled=True, **signs), 1000, Group()))
        opt = student_adam(d.params, adam)
        step = functools.partial(d.step, list(range(batch)), opt, 1.0, 1.0, lr=1e-3, clip=1.0)
        row = measure(step, batch * WINDOW, 3 * sfpt, iters, windows, held)  # the live teacher's forward: not in the FLOPs
        if name in pair:
            paired[name] = step, fused_sign_step.triton
        if "tok_s" in row:
            row["MFU"] = round(row["TFLOP_s"] / matmul_tflops, 3)
            row["vs_dense"] = round(row["tok_s"] / rows["transformers (dense)"]["tok_s"], 2) if "tok_s" in rows["transformers (dense)"] else None
        if profile:  # where a mode's time goes: the ops with the most GPU time over two steps, and the host's
            row["profile"] = profiled(step)
        rows[name] = row
        progress(rows)
        d = opt = student = step = None
        if name in paired:
            held += torch.cuda.memory_allocated() - before
    if len(paired) == 2 and all("tok_s" in rows[name] for name in paired):
        seconds = interleaved({name: step for name, (step, _) in paired.items()},
                              {name: functools.partial(setattr, fused_sign_step, "triton", kernels)
                               for name, (_, kernels) in paired.items()}, iters, windows)
        for name, s in seconds.items():
            rows[name]["tok_s_interleaved"] = round(batch * WINDOW / s)
        progress(rows)
    fused_sign_step.triton = triton
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--teacher", help="the real teacher as a CMF (nvg import-teacher); not needed with --modes")
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--windows", type=int, default=3, help="timed windows of --iters calls; the median is reported")
    ap.add_argument("--modes", action="store_true", help="only the distillation step, in each training mode")
    ap.add_argument("--shapes", nargs="+", default=["SmolLM2-135M"], choices=["SmolLM2-135M", "Llama-3.2-1B-shaped"],
                    help="with --modes: the model shapes (random weights)")
    ap.add_argument("--batch", type=int, nargs="+", default=[16], help="with --modes: windows a step, one per shape")
    ap.add_argument("--profile", action="store_true", help="with --modes: each mode's profile of two steps")
    ap.add_argument("--only", nargs="+", help="with --modes: these modes alone (by name), beside the dense step")
    ap.add_argument("--plan-log", help="with --modes on SmolLM2's shape: the student's paths and ranks from a budget_reencode log "
                    "(e.g. docs/runs/budget-s46-live_uv_bsigns_055-hidden03-manuals30.log, the 0.55-bpw recipe's plan)")
    ap.add_argument("--compile-mode", help="with --modes: torch.compile's mode for the student's blocks (e.g. reduce-overhead)")
    ap.add_argument("--graph-per-signature", action="store_true",
                    help="with --modes: each block signature's compiled graphs in a dynamo cache of their own")
    ap.add_argument("--adam", default="one-pass", choices=["one-pass", "torch-groups", "torch-one-group"],
                    help="with --modes: the student's Adam (student_adam)")
    ap.add_argument("--recompute-every", type=int, default=1, choices=[0, 1],
                    help="with --modes: train.recompute_every of the timed steps (0: no block recomputed)")
    a = ap.parse_args()
    if a.modes and len(a.batch) != len(a.shapes):
        ap.error("--batch takes one value per --shapes")
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
           "window": WINDOW, "date": time.strftime("%Y-%m-%d")}
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    out["bf16_matmul_TFLOP_s"] = round(2 * 8192 ** 3 / timed(lambda: m @ m, 10) / 1e12, 1)
    if fp8.has_fp8_matmuls(torch.device("cuda")):  # the rate train.fp8's GEMMs run at
        m8, one = m.to(torch.float8_e4m3fn), torch.ones((), device="cuda")
        fp8_mm = lambda: torch._scaled_mm(m8, m8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
        out["fp8_matmul_TFLOP_s"] = round(2 * 8192 ** 3 / timed(fp8_mm, 10) / 1e12, 1)
        m8 = None
    m = None
    print(json.dumps(out), flush=True)
    if a.modes:
        out.update(plan_log=a.plan_log, compile_mode=a.compile_mode, graph_per_signature=a.graph_per_signature,
                   adam=a.adam, recompute_every=a.recompute_every, step={})
        write_json(a.out, out)
        shapes = {"SmolLM2-135M": SMOLLM2_135M, "Llama-3.2-1B-shaped": LLAMA_1B}
        for name, batch in zip(a.shapes, a.batch):
            def progress(rows, name=name):
                """Each finished row into the JSON at once: a run stopped at its call's limit keeps what it measured
                (session 57 lost its matmul rates and 1B rows so)."""
                out["step"][name] = rows
                write_json(a.out, out)
                print(json.dumps(rows), flush=True)
            step_modes(shapes[name], batch, a.iters, a.windows, out["bf16_matmul_TFLOP_s"], a.profile, a.only,
                       a.plan_log and read_plan(a.plan_log, shapes[name]), a.compile_mode, a.graph_per_signature,
                       a.adam, a.recompute_every, progress)
        print(json.dumps(out, indent=1))
        return
    smol = load_model(a.teacher, "cuda")
    out["SmolLM2-135M"] = bench_model("SmolLM2-135M", smol.cfg, smol, (8, 32), (8, 16), a.iters, keep_activations=True)
    del smol
    torch.manual_seed(0)
    big = hf_model(LLAMA_1B, None)  # random weights with transformers' initialisation
    state = {n: p.detach().float() for n, p in big.state_dict().items() if n != "lm_head.weight"}
    del big
    llama = build_model(LLAMA_1B, state.get).cuda()
    del state
    out["Llama-3.2-1B-shaped (random)"] = bench_model("Llama-1B", LLAMA_1B, llama, (8, 32), (8,), a.iters)
    print(json.dumps(out, indent=1))
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
