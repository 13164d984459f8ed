"""Distillation against the teacher's cached top-k: the targets, the trainable set, the schedule and
one optimizer step. Shared by train_student (scales, gains and any training mode) and dtgma_cut (gates).

Loss per token, from one of two kinds of targets:
  cached top-k (the default)  KL(teacher top-k renormalised ‖ student), the student's full-vocabulary
                              softmax gathered at the teacher's ids (`tail` adds the (k+1)-th bucket);
  live teacher                the teacher's forward runs in the same step: KL over the whole
                              vocabulary, plus `hidden_weight` × the per-layer loss on L2-normalised
                              hidden states (OneBit, LittleBit). Costs a teacher forward per step and
                              needs no top-k files; the held-out KL is then the full-vocabulary one.
                              The teacher is frozen, so what it gives each window is kept where it fits
                              (`Distiller._teacher`): the KL needs only its final-normed hidden states,
                              the hidden-state term every block's output.
Both are computed in token chunks (`losses.py`).

A training mode (sign training today) plugs into the step through hooks instead of calls spread
over the stage's loop; it is any object with
  name                          its key in snapshots, states and step results
  begin_step(lr_factor, gscale) before the backward pass (modes may act inside it)
  end_step() -> dict            after it: this step's statistics; "nonfinite" > 0 skips the step
  after_step(stats)             after a completed step: (metric fields, progress note, log lines)
  after_eval(kl, best_kl)       at an evaluation: (eval fields, log lines)
  snapshot() / restore(snap)    what the best checkpoint keeps: {name: tensor}
  state() / load_state(t, meta) the resumable state: ({name: tensor}, JSON-able dict)
  describe(), provenance()      a summary line; the record written into the student's provenance
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn.utils import parametrize

from nvg.artifacts import TopkReader, read_windows
from nvg.distributed import Group
from nvg.losses import full_kl, hidden_mse, topk_kl
from nvg.model import autocast

# A live teacher's outputs for every window are kept when they fit in this many bytes (`train.teacher_memo_gb`'s
# default; see `Distiller._teacher`)
TEACHER_MEMO_BYTES = 2 << 30


def lr_shape(step: int, total: int, decay: str = "cosine") -> float:
    """Linear warm-up over max(1, total/50) steps, then `decay` to zero at `total`: cosine, or linear (straight to
    zero, which at the same peak spends more of the run at a middling rate and less near zero)."""
    warm = max(1, total // 50)
    if step <= warm:
        return step / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return 1.0 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))


def trainable(model, train_group_scales: bool = True, train_dense_vocab: bool = False) -> dict[str, torch.nn.Parameter]:
    """h, ℓ, g of every BLR linear, every RMSNorm gain, with `train_group_scales` the group scales of a
    group-scaled embedding or LM head, and its code latents when `GroupScaled.train_codes` made them; with
    `train_dense_vocab` a dense (f16) embedding and LM head whole; everything else frozen."""
    params = {}
    group_scales = {id(p) for p in model.group_scales().values()} if train_group_scales else set()
    latents = {id(g.latent) for g in model.group_codes().values() if g.latent is not None}  # GroupScaled.train_codes
    dense_vocab = {id(p) for p in model.dense_vocab().values()} if train_dense_vocab else set()
    for name, p in model.named_parameters():
        keep = (name.endswith((".h", ".ell", ".g")) or name.endswith("norm.weight") or id(p) in group_scales
                or id(p) in latents or id(p) in dense_vocab)
        p.requires_grad_(keep)
        if keep:
            params[name] = p
    return params


def param_groups(params: dict[str, torch.nn.Parameter], relative: bool, multiplier: dict[str, float] | None = None,
                 code_step: dict[str, float] | None = None) -> list[dict]:
    """Adam's parameter groups. Adam moves every entry by about lr per step whatever its size, so with one
    lr the small scales move fast and the large ones hardly at all (in a SmolLM2 student g is ~0.07 and
    h ~0.5: 3 % and 0.4 % per step at lr 0.002). `relative` gives each tensor its own group whose
    `lr_scale` is its RMS at the start, so that every tensor moves at the same relative rate. Code latents
    (`code_step`, name → the format's code step) move in code steps instead: lr is the fraction of a step.
    `multiplier` multiplies the step of the tensors it names (`train.group_scale_lr`, `group_code_lr`)."""
    multiplier, code_step = multiplier or {}, code_step or {}
    if not relative and not multiplier and not code_step:
        return [{"params": list(params.values()), "lr_scale": 1.0}]

    def size(name, p):
        if name in code_step:
            return code_step[name]
        return float(p.detach().float().pow(2).mean().sqrt().clamp_min(1e-8)) if relative else 1.0

    return [{"params": [p], "lr_scale": multiplier.get(name, 1.0) * size(name, p)} for name, p in params.items()]


@dataclass
class Targets:
    """The windows and, unless a live teacher gives the targets, the teacher's top-k for every window;
    rows ≥ n_train are held out."""

    tokens: np.ndarray  # [N, window] int32
    n_train: int
    windows_hash: str  # their tokens_blake2b: recorded in the trained student, checked by evaluate
    topk: TopkReader | None = None  # rows → (ids [b, window, k] int32, logp [b, window, k] float16)

    @classmethod
    def from_files(cls, windows: Path, topk: list[Path], vocab: int) -> "Targets":
        """Both checked on reading (`nvg/artifacts.py`): content hash, lineage, ranges, finiteness; the
        top-k stays in its files and is read batch by batch. No `topk` files: the windows alone, for a
        live teacher."""
        tokens, attrs = read_windows(windows, vocab)
        return cls(tokens, int(attrs["n_train"]), str(attrs["tokens_blake2b"]), TopkReader(topk, attrs, len(tokens), vocab) if topk else None)


class Distiller:
    """The student and its targets: loss, one optimizer step, held-out KL and snapshots."""

    def __init__(self, model, targets: Targets, device, *, batch: int, precision: str, tail: bool = False,
                 recompute_every: int = 0, group: Group = Group(), teacher=None, hidden_weight: float = 0.0,
                 hidden_decay: bool = False, kl_alone_ahead: bool = False, train_group_scales: bool = True,
                 train_dense_vocab: bool = False, teacher_memo_bytes: int = TEACHER_MEMO_BYTES):
        """`kl_alone_ahead`: training steps without the hidden-state term will come (`train.hidden_epochs`: the fit
        loop sets `hidden_on`), so the teacher's final-normed hidden states are worth keeping while it runs."""
        self.model, self.targets, self.device, self.group = model, targets, device, group
        self.batch_size, self.precision, self.tail = batch, precision, tail
        self.teacher, self.hidden_weight = teacher, hidden_weight  # a live teacher: see the module docstring
        # with hidden_decay each step scales the hidden-state term by its lr factor (the schedule's shape); a factor
        # of 0 still runs the term, so it changes no memo. hidden_on: the term is in this step's loss at all
        self.hidden_decay, self.hidden_factor, self.hidden_on = hidden_decay, 1.0, hidden_weight > 0
        # What each window's teacher run leaves (`_teacher`): every block's output where the hidden-state term needs
        # them and they all fit, else its final-normed hidden states where the KL alone will read them again and
        # those fit. Neither: the teacher runs every step (the GPU recipe's 30 layers of 16,320 windows).
        live = teacher is not None
        self._residual_memo = {} if live and hidden_weight > 0 and self._teacher_bytes(everything=True) <= teacher_memo_bytes else None
        self._hidden_memo = {} if (live and self._residual_memo is None and (hidden_weight == 0 or kl_alone_ahead)
                                   and self._teacher_bytes(everything=False) <= teacher_memo_bytes) else None
        self.params = trainable(model, train_group_scales, train_dense_vocab)
        # memory, not results: on CUDA every k-th block is recomputed in backward; the CPU keeps all
        self.recompute_every = recompute_every if device.type == "cuda" else 0
        self.modes: list = []  # training modes, see the module docstring
        # the next batch's top-k, read while this one trains (see `prefetch`); a live teacher needs none
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="topk") if targets.topk is not None else None
        self._ahead: tuple[tuple, Future] | None = None

    def prefetch(self, rows) -> None:
        """Start reading the top-k of `rows` (the next batch) in a background thread, so that the HDF5
        read and, on CUDA, the copy into pinned memory overlap this step's GPU work instead of
        stalling the next one."""
        if self._reader is not None:
            mine = tuple(self.group.shard(rows))
            self._ahead = (mine, self._reader.submit(self._read_targets, mine))

    def _read_targets(self, rows) -> tuple[torch.Tensor, torch.Tensor]:
        ids, logp = (torch.from_numpy(a) for a in self.targets.topk.read(list(rows)))
        if self.device.type == "cuda":  # pinned: the host-to-device copy below runs asynchronously
            ids, logp = ids.pin_memory(), logp.pin_memory()
        return ids, logp

    def _targets(self, rows) -> tuple[torch.Tensor, torch.Tensor]:
        ahead = self._ahead
        if ahead is not None and ahead[0] == tuple(rows):  # an evaluation in between reads its own rows
            self._ahead = None
            t = ahead[1].result()
        else:
            t = self._read_targets(rows)
        return tuple(x.to(self.device, non_blocking=True) for x in t)

    def _teacher_bytes(self, everything: bool) -> int:
        """What `_teacher` keeps for every window: every block's output (`everything`) or the final-normed hidden
        states, in the compute dtype (float32 but under bf16 or fp16)."""
        n, window = self.targets.tokens.shape
        kept = len(self.teacher.model.layers) if everything else 1
        return n * window * self.teacher.head_weight.shape[1] * kept * (2 if self.precision in ("bf16", "fp16") else 4)

    def keeps_teacher_hidden(self) -> bool:
        """Whether a window's final-normed teacher hidden states are kept once the teacher has run on it."""
        return self._residual_memo is not None or self._hidden_memo is not None

    @torch.no_grad()
    def _teacher(self, rows, ids, residuals: bool) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """The live teacher's final-normed hidden states for `rows` ([b, t, hidden]), and with `residuals` its
        residual stream (every block's output, for the hidden-state term; else None). Kept per window where they
        fit in `teacher_memo_bytes` (see `__init__`): the teacher is frozen, so a window seen again reads them
        instead of running it (on a 2-core CPU 0.29 s of the default job's 1.7-s live step in bf16; on the GPU
        recipe about a fifth of the step's multiply-adds, once `train.hidden_epochs` leaves the KL alone)."""
        rows = [int(r) for r in rows]
        if self._residual_memo is not None:
            memo = self._residual_memo
            if all(r in memo for r in rows):
                out = [torch.stack([memo[r][j] for r in rows]) for j in range(len(memo[rows[0]]))]
            else:
                out = list(self.teacher.residuals(ids))
                memo.update({r: [x[i].clone() for x in out] for i, r in enumerate(rows)})
            return self.teacher.model.norm(out[-1]), out
        memo = self._hidden_memo
        if not residuals and memo is not None and all(r in memo for r in rows):
            return torch.stack([memo[r] for r in rows]), None
        out = list(self.teacher.residuals(ids)) if residuals else None
        hidden = self.teacher.model.norm(out[-1]) if residuals else self.teacher.hidden(ids)
        if memo is not None:
            memo.update({r: hidden[i].clone() for i, r in enumerate(rows)})
        return hidden, out

    def loss(self, rows) -> torch.Tensor:
        """Mean per-token loss over `rows`: the KL, plus the hidden-state term when training against a
        live teacher (the held-out evaluation, without gradient, is the KL alone)."""
        ids = torch.from_numpy(self.targets.tokens[rows]).to(self.device)
        training = torch.is_grad_enabled()
        recompute = self.recompute_every if training else 0
        # cached(): a group-scaled embedding tied to the head is built from its codes and scales once a
        # step, for the lookup and the logits alike, instead of once for each
        with autocast(self.device, self.precision), parametrize.cached():
            if self.teacher is None:
                hidden = self.model.hidden(ids, recompute)
                t_ids, t_logp = self._targets(rows)
                return topk_kl(hidden, self.model.logits_head(), t_ids, t_logp, self.tail) / ids.numel()
            hidden_term = training and self.hidden_on
            t_hidden, t_res = self._teacher(rows, ids, residuals=hidden_term)
            if not hidden_term:
                hidden = self.model.hidden(ids, recompute)
                return full_kl(hidden, self.model.logits_head(), t_hidden, self.teacher.logits_head()) / ids.numel()
            res = list(self.model.residuals(ids, recompute))
            kl = full_kl(self.model.model.norm(res[-1]), self.model.logits_head(), t_hidden, self.teacher.logits_head())
            return kl / ids.numel() + self.hidden_weight * self.hidden_factor * hidden_mse(res, t_res)

    def step(self, rows, opt, lr_factor: float, gscale: float, *, lr: float, clip: float) -> dict:
        """Forward and backward on this process's share of `rows`, gradients averaged over processes,
        then, unless the loss, the gradient norm or a mode's statistics are non-finite, one Adam update at
        lr · `lr_factor` with the global norm clipped to `clip`. Returns loss, grad_norm, lr, skipped and
        each mode's statistics under its name."""
        for mode in self.modes:
            mode.begin_step(lr_factor, gscale)
        self.hidden_factor = lr_factor if self.hidden_decay else 1.0
        loss = self.loss(self.group.shard(rows))
        (loss * gscale).backward()
        stats = {mode.name: mode.end_step() for mode in self.modes}
        loss = float(self.group.sum(loss.detach().float()) / self.group.world)
        grads = [p.grad for p in self.params.values()]
        self.group.average_grads(grads)
        torch._foreach_div_(grads, gscale)
        gn = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
        nonfinite = sum(s.get("nonfinite", 0) for s in stats.values())
        result = {"loss": loss, "grad_norm": gn, "lr": lr * lr_factor, "modes": stats, "nonfinite_modes": nonfinite,
                  "skipped": not (math.isfinite(gn) and math.isfinite(loss)) or nonfinite > 0}
        if not result["skipped"]:
            for param_group in opt.param_groups:
                param_group["lr"] = result["lr"] * param_group.get("lr_scale", 1.0)
            if gn > clip:
                torch._foreach_mul_(grads, clip / gn)
            opt.step()
        opt.zero_grad(set_to_none=True)
        return result

    @torch.no_grad()
    def heldout_kl(self) -> float:
        rows = list(range(self.targets.n_train, len(self.targets.tokens)))
        mine = self.group.shard(rows)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for s in range(0, len(mine), self.batch_size):
            total += self.loss(mine[s : s + self.batch_size]).double() * len(mine[s : s + self.batch_size])
        return float(self.group.sum(total)) / len(rows)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The trained values and each mode's (the bits, with sign training): what the best checkpoint keeps."""
        snap = {n: p.detach().cpu().clone() for n, p in self.params.items()}
        for mode in self.modes:
            snap.update({f"{mode.name}/{k}": v for k, v in mode.snapshot().items()})
        return snap

    @torch.no_grad()
    def restore(self, snap: dict[str, torch.Tensor]) -> None:
        for n, p in self.params.items():
            p.copy_(snap[n].to(p.device))
        for mode in self.modes:
            prefix = f"{mode.name}/"
            mode.restore({k[len(prefix):]: v for k, v in snap.items() if k.startswith(prefix)})
