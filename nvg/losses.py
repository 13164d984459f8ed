"""LM-head work in token chunks: top-k log-probs, KL to a cached top-k or a live teacher, perplexity;
the per-layer hidden-state loss.

A [batch, window, vocab] float32 tensor never exists: each chunk of hidden states is projected to
float32 logits, reduced (log-sum-exp, top-k, gather) and dropped. In training on CUDA each chunk runs
under activation checkpointing, so backward recomputes that chunk's logits instead of keeping them:
peak memory is one [chunk, vocab] block, whatever the batch. The CPU keeps them (`_differentiable`): its
memory holds a chunk's logits easily, and the recomputed head GEMM and log-sum-exp were a tenth of the
default job's training step on 2 cores (docs/benchmarks.md).

On CUDA each block's work is compiled by inductor (`_on_device`): the float32 widening, log-sum-exp,
gather and softmax gradient over the [chunk, vocab] logits fuse into a few passes over memory instead
of one eager kernel (and one full-size temporary) each. The CPU runs the same functions eagerly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

GPU_CHUNK = 4096  # tokens per LM-head block on CUDA: 4096 × 49152 × 4 B = 0.8 GB
# On the CPU: the default job's [256, 49152] float32 blocks were fresh 50 MB allocations that each pass faulted into
# memory anew; at 128 tokens (25 MB) the KL's passes reuse freed memory, and the job's step took 1.10-1.16 s against
# 1.23-1.26 s at 256 (chunks of 64 and 32 lay between: docs/benchmarks.md, session 58).
CPU_CHUNK = 128
TOPK_BLOCK = 128  # vocabulary entries per block of the two-stage top-k

_compiled: dict = {}


def _chunk(x: torch.Tensor, chunk: int | None) -> int:
    """`chunk` tokens per LM-head block where given, else the device's."""
    return chunk or (GPU_CHUNK if x.is_cuda else CPU_CHUNK)


def _on_device(fn, x: torch.Tensor):
    """`fn` compiled once for CUDA tensors (dynamic shapes after the first recompile, for the last,
    shorter chunk); `fn` itself elsewhere."""
    if not x.is_cuda:
        return fn
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn)
    return _compiled[fn]


def _differentiable(block, args, h: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """`block(*args)`, under activation checkpointing when it is differentiable and on CUDA."""
    if h.is_cuda and torch.is_grad_enabled() and (h.requires_grad or head.requires_grad):
        return checkpoint(block, *args, use_reentrant=False)
    return block(*args)


def topk_last(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries of each row, exact (ties aside).

    Fast because it never sorts the vocabulary: the k winners lie in the k blocks of TOPK_BLOCK entries
    with the largest maxima (each winner's block has a maximum at least the k-th value, and only k
    entries are that large), so one pass takes the block maxima, a top-k over V/128 of them picks the
    blocks and a top-k over their k·128 entries finishes. On the H200 a [4096, 49152] block takes 1.1 ms
    in bf16, against 2.4 ms for torch.topk on float32 logits."""
    n, v = z.shape
    if v < 4 * k * TOPK_BLOCK:  # too few blocks for the first stage to prune anything
        return z.topk(k, dim=-1)
    pad = -v % TOPK_BLOCK
    if pad:
        z = F.pad(z, (0, pad), value=float("-inf"))
    blocks = z.view(n, -1, TOPK_BLOCK)
    _, best = blocks.amax(-1).topk(k, dim=-1)
    candidates = blocks.gather(1, best[..., None].expand(-1, -1, TOPK_BLOCK)).view(n, -1)
    vals, j = candidates.topk(k, dim=-1)
    return vals, best.gather(1, j // TOPK_BLOCK) * TOPK_BLOCK + j % TOPK_BLOCK


def _logits(h: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    # the matmul runs in the compute dtype (bf16 on tensor cores); only the result is widened
    return F.linear(h, head.to(h.dtype)).float()


def _topk_block(h, head, k: int):
    z = F.linear(h, head.to(h.dtype))  # top-k on the compute-dtype logits; the log-sum-exp in float32
    vals, idx = topk_last(z, k)
    return idx.int(), vals.float() - torch.logsumexp(z.float(), dim=-1, keepdim=True)


@torch.no_grad()
def topk_logprobs(hidden: torch.Tensor, head: torch.Tensor, k: int, chunk: int | None = None):
    """Per token the top-k ids (int32) and their log-probs over the full vocabulary (float32)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    block = _on_device(_topk_block, h)
    chunk = _chunk(h, chunk)
    ids, logp = zip(*(block(h[s : s + chunk], head, k) for s in range(0, h.shape[0], chunk)))
    return torch.cat(ids).view(*hidden.shape[:-1], k), torch.cat(logp).view(*hidden.shape[:-1], k)


def _kl_block(h, head, t_ids, t_logp, tail: bool):
    z = _logits(h, head)
    log_ps = z.gather(-1, t_ids.long()) - torch.logsumexp(z, dim=-1, keepdim=True)
    t_logp = t_logp.float()
    if not tail:
        log_q = t_logp - torch.logsumexp(t_logp, dim=-1, keepdim=True)  # teacher top-k renormalised
        return (log_q.exp() * (log_q - log_ps)).sum()
    # the (k+1)-th bucket: teacher tail mass against student tail mass, which removes the top-k bias
    q = t_logp.exp()
    q_tail = (1.0 - q.sum(-1)).clamp_min(1e-8)
    p_tail = (1.0 - log_ps.exp().sum(-1)).clamp_min(1e-8)
    return (q * (t_logp - log_ps)).sum() + (q_tail * (q_tail.log() - p_tail.log())).sum()


def topk_kl(hidden, head, t_ids, t_logp, tail: bool = False, chunk: int | None = None) -> torch.Tensor:
    """Sum over tokens of KL(teacher top-k ‖ student); differentiable, chunked (checkpointed on CUDA)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    ids = t_ids.reshape(-1, t_ids.shape[-1])
    lp = t_logp.reshape(-1, t_logp.shape[-1])
    total = hidden.new_zeros((), dtype=torch.float32)
    block = _on_device(_kl_block, h)
    chunk = _chunk(h, chunk)
    for s in range(0, h.shape[0], chunk):
        total = total + _differentiable(block, (h[s : s + chunk], head, ids[s : s + chunk], lp[s : s + chunk], tail), h, head)
    return total


def _full_kl_block(h, head, t_h, t_head):
    log_ps = torch.log_softmax(_logits(h, head), -1)
    log_pt = torch.log_softmax(_logits(t_h, t_head), -1)
    return (log_pt.exp() * (log_pt - log_ps)).sum()


def full_kl(hidden, head, t_hidden, t_head, chunk: int | None = None) -> torch.Tensor:
    """Sum over tokens of KL(teacher ‖ student) over the whole vocabulary, from both models' final
    hidden states (the live teacher's, without gradient); differentiable, chunked, on CUDA with checkpointing:
    backward recomputes both chunks' logits instead of keeping two [tokens, vocab] float32 blocks."""
    h = hidden.reshape(-1, hidden.shape[-1])
    t_h = t_hidden.reshape(-1, t_hidden.shape[-1]).detach()
    total = hidden.new_zeros((), dtype=torch.float32)
    block = _on_device(_full_kl_block, h)
    chunk = _chunk(h, chunk)
    for s in range(0, h.shape[0], chunk):
        total = total + _differentiable(block, (h[s : s + chunk], head, t_h[s : s + chunk], t_head), h, head)
    return total


def _normalized_sq_error(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    s, t = F.normalize(s.float(), dim=-1), F.normalize(t.float(), dim=-1)
    return (s - t).pow(2).sum(-1).mean()


def hidden_mse(residuals, t_residuals) -> torch.Tensor:
    """Σ over layers of the mean over tokens of ‖ĥ_s − ĥ_t‖², ĥ = h/‖h‖ (OneBit's per-layer loss on
    L2-normalised hidden states: scale-free, so no outlier dimension or deep layer dominates).
    Compiled on CUDA, one layer at a time: eager, each layer's widening, two norms, difference and square
    were a kernel and a float32 [batch, window, hidden] temporary each, forward and backward, 30 times a
    step; fused, a layer reads its two residuals once and autograd keeps them, not float32 copies."""
    total = residuals[0].new_zeros((), dtype=torch.float32)
    for s, t in zip(residuals, t_residuals, strict=True):
        total = total + _on_device(_normalized_sq_error, s)(s, t)
    return total


@torch.no_grad()
def next_token_nll(hidden, head, targets, chunk: int | None = None) -> torch.Tensor:
    """Sum of −log p(next token): hidden [.., t, H] predicts targets [.., t] (already shifted)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=hidden.device)
    chunk = _chunk(h, chunk)
    for s in range(0, h.shape[0], chunk):
        z = _logits(h[s : s + chunk], head)
        total += F.cross_entropy(z, y[s : s + chunk].long(), reduction="sum").double()
    return total


@torch.no_grad()
def student_scores(t_hidden, s_hidden, t_head, s_head, ids, chunk: int | None = None):
    """(Σ −log p(next token), Σ full-vocabulary KL(teacher ‖ student), tokens whose argmax agrees) of a
    student against the teacher on `ids` [b, t], from one log-softmax of each model per chunk (the
    last position of a window predicts nothing and counts in the KL only)."""
    th = t_hidden.reshape(-1, t_hidden.shape[-1])
    sh = s_hidden.reshape(-1, s_hidden.shape[-1])
    targets = F.pad(ids[:, 1:].long(), (0, 1), value=-100).reshape(-1)
    nll = torch.zeros((), dtype=torch.float64, device=t_hidden.device)
    kl = torch.zeros((), dtype=torch.float64, device=t_hidden.device)
    agree = 0
    chunk = _chunk(th, chunk)
    for s in range(0, th.shape[0], chunk):
        lt = torch.log_softmax(_logits(th[s : s + chunk], t_head), -1)
        ls = torch.log_softmax(_logits(sh[s : s + chunk], s_head), -1)
        nll += F.nll_loss(ls, targets[s : s + chunk], ignore_index=-100, reduction="sum").double()
        kl += (lt.exp() * (lt - ls)).sum().double()
        agree += int((lt.argmax(-1) == ls.argmax(-1)).sum())
    return nll, kl, agree
