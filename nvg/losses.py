"""LM-head work in token chunks: top-k log-probs, KL to a cached top-k, perplexity.

A [batch, window, vocab] float32 tensor never exists: each chunk of hidden states is projected to
float32 logits, reduced (log-sum-exp, top-k, gather) and dropped. In training each chunk runs under
activation checkpointing, so backward recomputes that chunk's logits instead of keeping them:
peak memory is one [chunk, vocab] block, whatever the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK = 4096  # tokens per LM-head block: 4096 × 49152 × 4 B = 0.8 GB on the GPU


def _logits(h: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    # the matmul runs in the compute dtype (bf16 on tensor cores); only the result is widened
    return F.linear(h, head.to(h.dtype)).float()


@torch.no_grad()
def topk_logprobs(hidden: torch.Tensor, head: torch.Tensor, k: int, chunk: int = DEFAULT_CHUNK):
    """Per token the top-k ids (int32) and their log-probs over the full vocabulary (float32)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    ids, logp = [], []
    for s in range(0, h.shape[0], chunk):
        z = _logits(h[s : s + chunk], head)
        vals, idx = z.topk(k, dim=-1)
        logp.append(vals - torch.logsumexp(z, dim=-1, keepdim=True))
        ids.append(idx.int())
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


def topk_kl(hidden, head, t_ids, t_logp, tail: bool = False, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Sum over tokens of KL(teacher top-k ‖ student); differentiable, chunked with checkpointing."""
    h = hidden.reshape(-1, hidden.shape[-1])
    ids = t_ids.reshape(-1, t_ids.shape[-1])
    lp = t_logp.reshape(-1, t_logp.shape[-1])
    total = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, h.shape[0], chunk):
        args = (h[s : s + chunk], head, ids[s : s + chunk], lp[s : s + chunk], tail)
        if torch.is_grad_enabled() and (h.requires_grad or head.requires_grad):
            total = total + checkpoint(_kl_block, *args, use_reentrant=False)
        else:
            total = total + _kl_block(*args)
    return total


@torch.no_grad()
def next_token_nll(hidden, head, targets, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Sum of −log p(next token): hidden [.., t, H] predicts targets [.., t] (already shifted)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=hidden.device)
    for s in range(0, h.shape[0], chunk):
        z = _logits(h[s : s + chunk], head)
        total += F.cross_entropy(z, y[s : s + chunk].long(), reduction="sum").double()
    return total


@torch.no_grad()
def full_kl_and_agreement(t_hidden, s_hidden, t_head, s_head, chunk: int = DEFAULT_CHUNK):
    """(Σ full-vocabulary KL(teacher ‖ student), number of tokens whose argmax agrees)."""
    th = t_hidden.reshape(-1, t_hidden.shape[-1])
    sh = s_hidden.reshape(-1, s_hidden.shape[-1])
    kl = torch.zeros((), dtype=torch.float64, device=t_hidden.device)
    agree = 0
    for s in range(0, th.shape[0], chunk):
        lt = torch.log_softmax(_logits(th[s : s + chunk], t_head), -1)
        ls = torch.log_softmax(_logits(sh[s : s + chunk], s_head), -1)
        kl += (lt.exp() * (lt - ls)).sum().double()
        agree += int((lt.argmax(-1) == ls.argmax(-1)).sum())
    return kl, agree
