"""One Llama-family model for the dense teacher and the BLR student.

The architecture is data (`ModelConfig`, read from a CMF `arch` header); what a linear is (dense or
BLR) is decided by the tensor found in the file. Module names follow the Hugging Face checkpoint, so
`state_dict()` keys are the CMF tensor names. Covers RMSNorm, rotary, GQA, SwiGLU, q/k/v biases and
q/k norms when present (Qwen2/Qwen3), and tied embeddings.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

from nvg import blr as blr_codec
from nvg import fp8
from nvg.cmf import (BLR, CODE_RANGE, F16, GROUP_SCALED, CmfFile, Tensor, dense_tensor, quant_groups, read_cmf, tensor_to_numpy,
                     with_group_codes, with_group_scales, write_cmf)
from nvg.errors import NvgError
from nvg.layout import BODY_ROLES


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    gemma_norm: bool = False

    @classmethod
    def from_arch(cls, arch: dict) -> "ModelConfig":
        if arch.get("hidden_act", "silu") != "silu":
            raise NvgError(f"arch.hidden_act {arch['hidden_act']!r}: only silu (SwiGLU) models are supported")
        if any(t != "FullAttention" for t in arch.get("layer_types", [])):
            raise NvgError("arch.layer_types: only FullAttention layers are supported")
        return cls(
            vocab_size=arch["vocab_size"], hidden_size=arch["hidden_size"],
            intermediate_size=arch["intermediate_size"], num_layers=arch["num_layers"],
            num_heads=arch["num_attention_heads"], num_kv_heads=arch["num_kv_heads"], head_dim=arch["head_dim"],
            rms_norm_eps=float(arch["rms_norm_eps"]), rope_theta=float(arch.get("rope_theta", 10000.0)),
            max_position_embeddings=arch["max_position_embeddings"],
            tie_word_embeddings=bool(arch.get("tie_word_embeddings", False)),
            gemma_norm=arch.get("norm_style", "qwen") == "gemma",
        )


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, gemma: bool):
        super().__init__()
        self.weight = nn.Parameter(weight.float())
        self.eps, self.gemma = eps, gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = 1.0 + self.weight if self.gemma else self.weight
        return (w * xf).to(x.dtype)


class DenseLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class BlrLinear(nn.Module):
    """y = x · Wᵀ with W = Σ_p diag(h_p) · S_U,p · diag(ℓ_p) · S_V,p · diag(g_p), W never formed.

    Fast because the scales are folded into the two sign factors before they meet the activations:
    A = [diag(ℓ_p) S_V,p diag(g_p)]_p (stacked to [P·r, d_in]) and B = [diag(h_p) S_U,p]_p ([d_out, P·r])
    cost weight-sized work, after which the tokens see exactly two GEMMs, y = (x Aᵀ) Bᵀ, on tensor
    cores (±1 is exact in bf16), and no activation-sized elementwise op at all. Backward is four GEMMs
    (two for the input gradient, one each for the A and B gradients); the scale gradients are then
    weight-sized reductions of those. The cost is P·r·(d_in + d_out) multiply-adds per token, about
    d_in·d_out at 1 bpw (docs/benchmarks.md).

    On the CPU a call sees few tokens (256 to 1,024 in a training step, one in decoding), so the weight-
    sized folding and the two weight-sized gradient GEMMs cost more than scaling the activations: there
    the scales are applied to x, to the rank-r product and to the output, and backward is the two
    input-gradient GEMMs plus token sums for h, ℓ and g (a training step of 256 tokens on 2 cores:
    2.02 s folded, 1.68 s so; docs/benchmarks.md)."""

    def __init__(self, payload: blr_codec.BlrTensor, bias: torch.Tensor | None = None):
        super().__init__()
        stack = lambda xs: torch.from_numpy(np.stack(xs)).float()  # noqa: E731
        self.h = nn.Parameter(stack([p.h for p in payload.paths]))  # [P, d_out]
        self.ell = nn.Parameter(stack([p.ell for p in payload.paths]))  # [P, r]
        self.g = nn.Parameter(stack([p.g for p in payload.paths]))  # [P, d_in]
        signs = [p.signs() for p in payload.paths]
        # ±1 in bf16, where they are exact: 2 bytes a sign (float32 took 4), read as the GEMM's own dtype on
        # CUDA. Parameters, frozen unless sign training asks for their gradients (nvg/sign_training.py).
        self.su = nn.Parameter(stack([s[0] for s in signs]).to(torch.bfloat16), requires_grad=False)  # [P, d_out, r]
        self.sv = nn.Parameter(stack([s[1] for s in signs]).to(torch.bfloat16), requires_grad=False)  # [P, r, d_in]
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.fp8 = False  # train.fp8: the GEMMs in fp8 with the scales on the activations (nvg/fp8.py)

    @property
    def rank(self) -> int:
        return self.ell.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        if self.fp8:
            y = fp8.blr_matmul(x.to(dt), self.h, self.ell, self.g, self.su, self.sv)
        elif x.is_cuda:
            paths, rank = self.ell.shape
            a = (self.sv * (self.ell[:, :, None] * self.g[:, None, :])).to(dt).reshape(paths * rank, self.g.shape[1])
            b = (self.su * self.h[:, :, None]).to(dt).permute(1, 0, 2).reshape(self.h.shape[1], paths * rank)
            y = F.linear(F.linear(x, a), b)
        else:
            t = torch.einsum("...pi,pri->...pr", x.unsqueeze(-2) * self.g.to(dt), self.sv.to(dt)) * self.ell.to(dt)
            y = (torch.einsum("...pr,por->...po", t, self.su.to(dt)) * self.h.to(dt)).sum(-2)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dense_weight(self) -> torch.Tensor:
        return torch.einsum("po,por,pr,pri,pi->oi", self.h, self.su.float(), self.ell, self.sv.float(), self.g)

    def to_payload(self) -> blr_codec.BlrTensor:
        """Back to the codec (scales rounded to f16 on encode; signs from the ±1 buffers)."""
        return blr_codec.BlrTensor.from_factors([
            (self.h[p].detach().cpu().numpy(), self.g[p].detach().cpu().numpy(), self.ell[p].detach().cpu().numpy(),
             self.su[p].detach().float().cpu().numpy(), self.sv[p].detach().float().cpu().numpy())
            for p in range(self.h.shape[0])
        ])


class BlrVocab(BlrLinear):
    """A BLR token embedding or LM head (`encode.embedding: blr`), [vocab, hidden]: the factors, scales and
    signs of `BlrLinear` (so training, sign training and `write_student` treat it as one more BLR tensor).
    A lookup gathers only the S_U rows of its tokens and multiplies them by S_V: rank × hidden work a token,
    the vocabulary-sized matrix never formed. `weight` (the head's use, chunked logits against it) forms it
    once a call: rank × vocab × hidden multiply-adds, small beside a training step's tokens."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ell = self.ell.view(self.ell.shape[0], *[1] * ids.dim(), self.rank)
        rows = self.su[:, ids].float() * self.h[:, ids].unsqueeze(-1) * ell  # [P, *ids, r]
        return torch.einsum("p...r,pri->...i", rows, self.sv.float() * self.g[:, None, :])

    @property
    def weight(self) -> torch.Tensor:
        return self.dense_weight()


def rotary_tables(cfg: ModelConfig, seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32) / cfg.head_dim))
    ang = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class KVCache(nn.Module):
    """Static K/V buffers of one attention layer, [batch, kv_heads, max_len + 1, head_dim] (as gpt-fast's):
    a decoding step writes its positions in place, so every step has the same shapes, which is what
    lets a compiled step be captured once as a CUDA graph and replayed."""

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        super().__init__()
        # one position more than a step ever reads: a slice [:kv_len] is then never the whole buffer, so it has one
        # memory layout at every kv_len, and a compiled block is not compiled again for the last bucket (torch
        # guards on whether the slice is contiguous)
        shape = (batch, kv_heads, max_len + 1, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.k.index_copy_(2, pos, k.to(self.k.dtype))
        self.v.index_copy_(2, pos, v.to(self.v.dtype))
        return self.k, self.v


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Attention of the tokens at `pos` against the KV cache, as two GEMMs and a float32 softmax. Not fused SDPA:
    on the H200 its decoding kernel sums key blocks in a run-dependent order, so one seed sampled other tokens
    from about position 68 on (7 of 512 sequences alike twice in one process; this form: 512 of 512, at 13 %
    fewer tokens/s; docs/reliability.md). The query heads that share a K/V head are rows of one GEMM, so K/V are
    not repeated; the cache is a few hundred keys, so the [t, kv_len] scores are small."""
    b, heads, t, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    scores = torch.matmul(q.reshape(b, kv_heads, group * t, d) * d**-0.5, k.transpose(-1, -2))
    visible = torch.arange(k.shape[2], device=pos.device)[None, :] <= pos[:, None]  # [t, kv_len]
    scores = scores.float().masked_fill(~visible.repeat(group, 1), float("-inf"))
    return torch.matmul(scores.softmax(-1).to(v.dtype), v).reshape(b, heads, t, d)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, linears: dict, norms: dict):
        super().__init__()
        self.cfg = cfg
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (linears[r] for r in ("q", "k", "v", "o"))
        self.q_norm = norms.get("q_norm")
        self.k_norm = norms.get("k_norm")
        self.kv_cache: KVCache | None = None  # set by Llama.setup_cache for decoding

    def forward(self, x, cos, sin, pos: torch.Tensor | None = None, kv_window: torch.Tensor | None = None):
        """`pos` (the positions of x's tokens) decodes against the cached positions `kv_window` (the first
        len(kv_window) of the cache; all when None); without it, causal attention over x alone. The window is a
        tensor, not an int, so that a compiled block sees its length as a size it can mark dynamic: one compile
        then serves every length (`nvg.decoding`)."""
        b, t, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(b, t, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(b, t, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(b, t, c.num_kv_heads, c.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if pos is None:
            # flash/memory-efficient SDPA with native GQA: no repeated K/V, no [t, t] score matrix in memory
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=c.num_kv_heads != c.num_heads)
        else:
            k, v = self.kv_cache.update(pos, k, v)
            kv_len = None if kv_window is None else kv_window.shape[0]
            y = cached_attention(q.to(k.dtype), k[:, :, :kv_len], v[:, :, :kv_len], pos)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, c.num_heads * c.head_dim))


class MLP(nn.Module):
    def __init__(self, linears: dict):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = linears["gate"], linears["up"], linears["down"]

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg, linears, norms):
        super().__init__()
        self.input_layernorm = norms["input_layernorm"]
        self.post_attention_layernorm = norms["post_attention_layernorm"]
        self.self_attn = Attention(cfg, linears, norms)
        self.mlp = MLP(linears)

    def forward(self, x, cos, sin, recompute: bool = False, pos: torch.Tensor | None = None,
                kv_window: torch.Tensor | None = None):
        """`recompute`: keep only this block's input for backward and run it again there (activation
        checkpointing): the saved activations of a layer shrink from ~20 vectors per token to one.
        `pos`, `kv_window`: decode against the KV cache (see `Attention.forward`)."""
        if recompute:
            return checkpoint(self.residual_stream, x, cos, sin, use_reentrant=False)
        return self.residual_stream(x, cos, sin, pos, kv_window)

    def residual_stream(self, x, cos, sin, pos=None, kv_window=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, pos, kv_window)
        return x + self.mlp(self.post_attention_layernorm(x))


def nearest_code(x: torch.Tensor, code_range: tuple[int, int, int]) -> torch.Tensor:
    """The nearest code a group-scaled format allows (`cmf.CODE_RANGE`: lo, hi, spacing; q2tp's are the odd −3 … 3)."""
    lo, hi, spacing = code_range
    return torch.clamp(torch.round((x - lo) / spacing) * spacing + lo, lo, hi)


class GroupScaled(nn.Module):
    """The weight of a q8_row, q4_block, q4tp or q2tp tensor (the embedding, an untied LM head) as a
    parametrization (torch.nn.utils.parametrize): integer codes, one trainable scale per group (a row of
    q8_row, 32 values of the others), weight = code · scale. So a student with a quantised embedding trains
    the very scales its file stores. The codes stay those the encoder chose unless `train_codes` gives each
    a real-valued latent: the forward then uses the latent rounded to the nearest code the format allows,
    and the gradient passes the rounding straight through (STE), so a code moves once its latent crosses
    half a code step."""

    def __init__(self, codes: torch.Tensor, shape: tuple[int, ...], code_range: tuple[int, int, int]):
        super().__init__()
        self.register_buffer("codes", codes)  # int8 [groups, group size]
        self.shape = tuple(shape)
        self.code_range = code_range  # cmf.CODE_RANGE: lo, hi, spacing
        self.latent: nn.Parameter | None = None

    def train_codes(self) -> nn.Parameter:
        """Make the codes trainable: float32 latents [groups, group size] starting at the codes (12 bytes a
        weight with Adam's moments: 0.34 GB for SmolLM2's 28.3M-entry embedding)."""
        self.latent = nn.Parameter(self.codes.float())
        return self.latent

    def current_codes(self) -> torch.Tensor:
        """The codes the forward uses, int8 [groups, group size]."""
        if self.latent is None:
            return self.codes
        return nearest_code(self.latent.detach(), self.code_range).to(torch.int8)

    def forward(self, scales: torch.Tensor) -> torch.Tensor:
        if self.latent is None:
            codes = self.codes.to(scales.dtype)
        else:  # straight through: the rounded value forward, the identity backward
            codes = (self.latent + (nearest_code(self.latent, self.code_range) - self.latent).detach()).to(scales.dtype)
        flat = (codes * scales[:, None]).reshape(-1)
        return flat[: math.prod(self.shape)].reshape(self.shape)

    def right_inverse(self, weight: torch.Tensor) -> torch.Tensor:
        """Each group's least-squares scale for `weight` (exactly the stored scale when these codes encode it)."""
        c = self.codes.to(weight.dtype)
        w = F.pad(weight.reshape(-1), (0, c.numel() - weight.numel())).reshape(c.shape)
        return (c * w).sum(1) / (c * c).sum(1).clamp_min(1)


def group_scaled(module: nn.Module, t) -> nn.Module:
    """`module.weight` becomes the group-scaled CMF tensor `t` (q8_row, q4_block, q4tp, q2tp): its codes
    fixed, its scales (the file's, bit for bit) the trainable parameter behind the weight."""
    codes, scales = quant_groups(t)
    parametrize.register_parametrization(module, "weight", GroupScaled(torch.from_numpy(codes), t.shape, CODE_RANGE[t.dtype]))
    module.parametrizations.weight.original.data.copy_(torch.from_numpy(scales))
    return module


class Body(nn.Module):
    def __init__(self, embed, layers, norm):
        super().__init__()
        self.embed_tokens = BlrVocab(embed) if isinstance(embed, blr_codec.BlrTensor) else nn.Embedding.from_pretrained(embed, freeze=True)
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig, body: Body, lm_head: torch.Tensor | None):
        super().__init__()
        self.cfg = cfg
        self.model = body
        self.cuda_graph_passes = False  # compile_blocks sets it when the blocks replay CUDA graphs
        self._logits_head: tuple | None = None  # (frozen head, its version, its autocast-dtype copy): `logits_head`
        if lm_head is not None:
            self.lm_head = BlrVocab(lm_head) if isinstance(lm_head, blr_codec.BlrTensor) else DenseLinear(lm_head)

    @property
    def head_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the LM head (the embedding when tied)."""
        return self.lm_head.weight if hasattr(self, "lm_head") else self.model.embed_tokens.weight

    def logits_head(self) -> torch.Tensor:
        """`head_weight` as the logits GEMM takes it under autocast. A frozen head (a teacher's; a student's f16
        embedding unless train.embedding_lr trains it) is cast to autocast's dtype once and kept, not in every
        call: each cast of SmolLM2's 49152 × 576 head took 20-70 ms of the CPU default job's 1.3 s step, twice a
        step (docs/benchmarks.md, session 58). A trained or rebuilt head (group-scaled: a new tensor each call)
        is returned as it is."""
        w = self.head_weight
        if w.requires_grad or not isinstance(w, nn.Parameter) or not torch.is_autocast_enabled(w.device.type):
            return w
        dtype = torch.get_autocast_dtype(w.device.type)
        kept = self._logits_head
        if kept is None or kept[0] is not w or kept[1] != w._version or kept[2].dtype != dtype or kept[2].device != w.device:
            kept = self._logits_head = (w, w._version, w.detach().to(dtype))
        return kept[2]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings in the compute dtype (autocast's when it is on)."""
        x = self.model.embed_tokens(ids)
        return x.to(torch.get_autocast_dtype(x.device.type)) if torch.is_autocast_enabled(x.device.type) else x

    def hidden(self, ids: torch.Tensor, recompute_every: int = 0) -> torch.Tensor:
        """Final-normed hidden states [b, t, hidden]; logits are `hidden @ head_weight.T`, taken in chunks.
        `recompute_every` k > 0 checkpoints every k-th block (see `Block.forward`)."""
        for x in self.residuals(ids, recompute_every):
            pass
        return self.model.norm(x)

    def residuals(self, ids: torch.Tensor, recompute_every: int = 0):
        """Yields the residual stream after each block, [b, t, hidden]: a caller that keeps them all (the
        hidden-state loss) holds them; one that wants the last (`hidden`) lets each go in turn."""
        if ids.shape[1] > self.cfg.max_position_embeddings:
            raise NvgError(f"window of {ids.shape[1]} tokens exceeds the model's max_position_embeddings {self.cfg.max_position_embeddings}")
        if self.cuda_graph_passes:
            # Each compiled block is a torch.compile invocation of its own. Unmarked, CUDA graph trees begin a
            # new generation at each one that has no backward pending (a no_grad evaluation), and its replay
            # overwrites the block before's output (session 50's first GPU run failed so): one pass, one step.
            torch.compiler.cudagraph_mark_step_begin()
        x = self.embed(ids)
        cos, sin = rotary_tables(self.cfg, ids.shape[1], ids.device)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, recompute_every > 0 and i % recompute_every == 0)
            yield x

    def setup_cache(self, batch: int, max_len: int, dtype) -> None:
        """KV caches for decoding `batch` sequences of up to `max_len` tokens, and rotary tables for them."""
        c, device = self.cfg, self.head_weight.device
        if max_len > c.max_position_embeddings:
            raise NvgError(f"{max_len} tokens exceed the model's max_position_embeddings {c.max_position_embeddings}")
        for layer in self.model.layers:
            layer.self_attn.kv_cache = KVCache(batch, c.num_kv_heads, max_len, c.head_dim, dtype, device)
        self.rope = rotary_tables(c, max_len, device)

    def decode(self, ids: torch.Tensor, pos: torch.Tensor, kv_window: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states [b, t, hidden] of tokens `ids` [b, t] at positions `pos` [t],
        attending to what is cached before them within the cached positions `kv_window` (its first
        len(kv_window); the whole cache when None; `setup_cache` first)."""
        x = self.embed(ids)
        cos, sin = self.rope[0][pos], self.rope[1][pos]
        for layer in self.model.layers:
            x = layer(x, cos, sin, pos=pos, kv_window=kv_window)
        return self.model.norm(x)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Full logits: for tests and small inputs only (the pipeline never materialises these)."""
        h = self.hidden(ids)
        return F.linear(h, self.head_weight.to(h.dtype))

    def blr_linears(self) -> dict[str, BlrLinear]:
        return {f"{n}.weight": m for n, m in self.named_modules() if isinstance(m, BlrLinear)}

    def norm_gains(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.named_parameters() if n.endswith("norm.weight")}

    def vocab_modules(self) -> dict[str, nn.Module]:
        """The embedding and, when untied, the LM head, by CMF name."""
        modules = {"model.embed_tokens.weight": self.model.embed_tokens, "lm_head.weight": getattr(self, "lm_head", None)}
        return {name: m for name, m in modules.items() if m is not None}

    def quantised_vocab(self) -> dict[str, nn.Module]:
        """The embedding and LM head when group-scaled (q8_row, q4_block, q4tp, q2tp: their weight a
        `GroupScaled` parametrization), by CMF name."""
        return {name: m for name, m in self.vocab_modules().items() if parametrize.is_parametrized(m, "weight")}

    def dense_vocab(self) -> dict[str, nn.Parameter]:
        """The embedding and LM head when stored dense (f16, bf16, f32; neither BLR nor group-scaled): their
        weights, by CMF name."""
        return {name: m.weight for name, m in self.vocab_modules().items()
                if isinstance(m, (nn.Embedding, DenseLinear)) and not parametrize.is_parametrized(m, "weight")}

    def group_scales(self) -> dict[str, nn.Parameter]:
        """The trainable scales of a group-scaled embedding or LM head, by CMF name."""
        return {name: m.parametrizations.weight.original for name, m in self.quantised_vocab().items()}

    def group_codes(self) -> dict[str, GroupScaled]:
        """The codes of a group-scaled embedding or LM head (`GroupScaled.train_codes` makes them trainable), by CMF name."""
        return {name: m.parametrizations.weight[0] for name, m in self.quantised_vocab().items()}


def build_model(cfg: ModelConfig, get) -> Llama:
    """Assemble a model; `get(name)` returns a float32 torch tensor, a `blr.BlrTensor`, or None if absent."""

    def need(name):
        t = get(name)
        if t is None:
            raise NvgError(f"tensor {name!r} is missing")
        return t

    def norm(name):
        return RMSNorm(need(name), cfg.rms_norm_eps, cfg.gemma_norm)

    layers = []
    for i in range(cfg.num_layers):
        linears = {}
        for role, suffix in BODY_ROLES.items():
            w = need(f"model.layers.{i}.{suffix}.weight")
            b = get(f"model.layers.{i}.{suffix}.bias")
            linears[role] = BlrLinear(w, b) if isinstance(w, blr_codec.BlrTensor) else DenseLinear(w, b)
        norms = {n: norm(f"model.layers.{i}.{n}.weight") for n in ("input_layernorm", "post_attention_layernorm")}
        if get(f"model.layers.{i}.self_attn.q_norm.weight") is not None:
            norms["q_norm"] = norm(f"model.layers.{i}.self_attn.q_norm.weight")
            norms["k_norm"] = norm(f"model.layers.{i}.self_attn.k_norm.weight")
        layers.append(Block(cfg, linears, norms))
    body = Body(need("model.embed_tokens.weight"), layers, norm("model.norm.weight"))
    lm_head = None if cfg.tie_word_embeddings else get("lm_head.weight")
    if lm_head is None and not cfg.tie_word_embeddings:
        raise NvgError("tensor 'lm_head.weight' is missing and the embeddings are not tied")
    return Llama(cfg, body, lm_head)


def load_model(source: str | CmfFile, device: str | torch.device = "cpu") -> Llama:
    """A model from a CMF file: dense tensors dequantised to float32, BLR tensors kept factored."""
    cmf = source if isinstance(source, CmfFile) else read_cmf(source)
    cfg = ModelConfig.from_arch(cmf.arch)

    def get(name):
        t = cmf.tensors.get(name)
        if t is None:
            return None
        if t.dtype == BLR:
            return blr_codec.decode(bytes(t.data))
        return torch.from_numpy(tensor_to_numpy(t))

    with torch.device("cpu"):
        model = build_model(cfg, get)
        for name, module in (("model.embed_tokens.weight", model.model.embed_tokens), ("lm_head.weight", getattr(model, "lm_head", None))):
            t = cmf.tensors.get(name)
            if module is not None and t is not None and t.dtype in GROUP_SCALED:
                group_scaled(module, t)
    return model.to(device).eval()


def write_student(student_cmf: CmfFile, model: "Llama", out, provenance_key: str, provenance_block: dict) -> None:
    """`load_model` backwards: a copy of the student file with the model's trained payload values, same
    tensors, shapes, dtypes and sizes, and `provenance_block` recorded under `provenance_key`. Group
    scales that were not trained (their `requires_grad` off) keep their bytes: writing refits q4tp's and
    q2tp's ladders, which would move them; so does a dense embedding or head that was not trained
    (`train.embedding_lr` 0). Trained codes (`train.group_code_lr`) are written first, then the scales."""
    blr = model.blr_linears()
    gains = model.norm_gains()
    group_scales = {name: p for name, p in model.group_scales().items() if p.requires_grad}
    group_codes = {name: g for name, g in model.group_codes().items() if g.latent is not None}
    dense_vocab = {name: p for name, p in model.dense_vocab().items() if p.requires_grad}  # train.embedding_lr
    tensors = []
    for name, t in student_cmf.tensors.items():
        if name in blr and t.dtype == BLR:
            data = blr[name].to_payload().encode()
        elif name in gains and t.dtype == F16:
            data = dense_tensor(name, gains[name].detach().cpu().numpy(), F16).data
        elif name in dense_vocab:
            data = dense_tensor(name, dense_vocab[name].detach().cpu().numpy(), t.dtype).data
        elif name in group_scales or name in group_codes:
            data = t.data
            if name in group_codes:
                data = with_group_codes(t, group_codes[name].current_codes().cpu().numpy())
            if name in group_scales:
                data = with_group_scales(Tensor(name, t.dtype, t.shape, data), group_scales[name].detach().float().cpu().numpy())
        else:
            data = t.data
        if len(data) != len(t.data):
            raise NvgError(f"{name}: exported payload is {len(data)} bytes, the student's is {len(t.data)}")
        tensors.append(Tensor(name, t.dtype, t.shape, data))
    header = dict(student_cmf.header)
    header["provenance"] = {**header.get("provenance", {}), provenance_key: provenance_block}
    write_cmf(out, header, tensors, student_cmf.vocab)


# Graphs dynamo may keep per block signature: training (checkpointed), no-grad evaluation, and the
# recompiles with dynamic batch and sequence dimensions when those change.
GRAPHS_PER_SIGNATURE = 4


def compile_blocks(model: Llama, mode: str | None = None) -> Llama:
    """On CUDA, compile each block with inductor (regional compilation): RMSNorm, rotary, SwiGLU, the
    residual adds and the BLR scale folding become a few fused kernels instead of dozens of eager ones.
    Blocks whose parameters have the same shapes share a compiled graph (the parameters are graph
    inputs), so this costs one compile per block signature, not one of the whole model. Elsewhere the
    model runs eager: the CPU path is the reference.

    Dynamo keeps at most `recompile_limit` graphs (8) for `Block.forward`, across every model in the
    process, and past it runs the remaining blocks eager without failing. A mixed plan has one signature
    per distinct combination of paths and ranks in a block (10 at 0.55 bpw on SmolLM2 with paths auto),
    and there its training ran at half speed (81k tok/s against 168k at 1.0 bpw, where there are 3):
    so the limit grows with the signatures compiled. `mode`: torch.compile's; reduce-overhead (CUDA graphs,
    `train.cuda_graphs`) makes each pass of the model one CUDA-graph step (see `residuals`)."""
    if model.head_weight.is_cuda:
        signatures = {tuple(p.shape for p in layer.parameters()) for layer in model.model.layers}
        torch._dynamo.config.recompile_limit += GRAPHS_PER_SIGNATURE * len(signatures)
        for layer in model.model.layers:
            layer.compile(mode=mode)
        model.cuda_graph_passes = mode in ("reduce-overhead", "max-autotune")
    return model


def pick_device(requested: str = "auto", shard: int | None = None) -> torch.device:
    """The config's device. For shard k of a sharded stage, `auto` is GPU k mod the GPUs this process sees:
    Snakemake's local scheduler runs shards side by side but hands out no GPU ids, so on one machine with several
    GPUs they would all share the first; a cluster job sees only its own GPU, so there it is cuda:0. Elsewhere
    `auto` is the current CUDA device (torchrun sets it per process) or the CPU. A numbered GPU is made the current
    device, because CUDA graphs and Triton kernels launch on the current one."""
    if requested == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        requested = "cuda" if shard is None else f"cuda:{shard % torch.cuda.device_count()}"
    elif requested.startswith("cuda") and not torch.cuda.is_available():
        raise NvgError(f"device {requested!r}: this torch ({torch.__version__}) sees no CUDA GPU; use cpu or auto")
    device = torch.device(requested)
    if device.type == "cuda" and device.index is not None:
        if device.index >= torch.cuda.device_count():
            raise NvgError(f"device {requested!r}: this process sees {torch.cuda.device_count()} CUDA GPU(s)")
        torch.cuda.set_device(device)
    return device


BF16_CPU_MIN_SPEEDUP = 1.5  # bf16 must beat float32 by this much: measured 4.4× and 0.62×, so no timing noise flips it


def matmul_seconds(dtypes, shape=(256, 576, 1536), reps: int = 10) -> dict:
    """The fastest of `reps` products of a [m, k] and a [k, n] matrix on one CPU thread in each of `dtypes`
    (one warm-up each, the dtypes taking turns). One thread, because a load on the same cores slows MKL's
    multi-threaded float32 GEMM far more than oneDNN's bf16 one: on session 22's 2-core Intel Xeon, with
    another process multiplying beside it, both threads measured float32 at 11.9 ms and bf16 at 8.0 (bf16
    would have been chosen) where alone they measure 2.0 and 3.0; one thread measured 3.1 and 5.6 either way."""
    m, k, n = shape
    pairs = {dtype: (torch.ones(m, k, dtype=dtype), torch.ones(k, n, dtype=dtype)) for dtype in dtypes}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for a, b in pairs.values():
            a @ b
        best = dict.fromkeys(dtypes, float("inf"))
        for _ in range(reps):
            for dtype, (a, b) in pairs.items():
                t0 = time.perf_counter()
                a @ b
                best[dtype] = min(best[dtype], time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return best


@functools.cache
def cpu_has_bf16_matmuls() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX) *and* faster than float32, by
    at least BF16_CPU_MIN_SPEEDUP at a training shape (a window of 256 tokens × 576 × 1536). The flags alone do
    not say it: on a 2-core AMD EPYC oneDNN's bf16 GEMM ran 4.4× MKL's float32 one, on a 2-core Intel Xeon with
    AVX512-BF16 (no AMX) MKL's float32 ran 229 GFLOP/s and bf16 142 (0.62×), and the default job took 21.6
    minutes in bf16 there (session 20). Without the flags bf16 is emulated. Asked once a process (each autocast
    asks); every torch stage logs what it computes in (`computing_in`), train_student records it too."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch's own CPU probes (private: default False)
    if not any(getattr(torch.cpu, probe, lambda: False)() for probe in probes):
        return False
    seconds = matmul_seconds((torch.float32, torch.bfloat16))
    return seconds[torch.float32] >= BF16_CPU_MIN_SPEEDUP * seconds[torch.bfloat16]


def compute_precision(device: torch.device, precision: str) -> str:
    """What a stage set to `precision` computes in: bf16/fp16 on CUDA; bf16 on a CPU whose bf16 matmuls are
    native and faster (`cpu_has_bf16_matmuls`); else fp32."""
    if device.type == "cuda" and precision in ("bf16", "fp16"):
        return precision
    if device.type == "cpu" and precision == "bf16" and cpu_has_bf16_matmuls():
        return "bf16"
    return "fp32"


def computing_in(device: torch.device, key: str, precision: str) -> str:
    """The line a torch stage logs before it computes, e.g. "computing in fp32 on cpu (train.precision bf16)":
    a CPU run set to bf16 says when it computes in float32 instead (`compute_precision`)."""
    return f"computing in {compute_precision(device, precision)} on {device} ({key} {precision})"


def autocast(device: torch.device, precision: str):
    """The autocast context of `compute_precision`."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(compute_precision(device, precision))
    return torch.autocast(device.type, dtype=dtype) if dtype else torch.autocast(device.type, enabled=False)


def flops_per_token(cfg: ModelConfig) -> float:
    """Dense forward matmul FLOPs per token (2 per multiply-add), for model FLOP utilisation."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    attn = d * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    return 2.0 * (cfg.num_layers * (attn + 3 * d * f) + d * cfg.vocab_size)

