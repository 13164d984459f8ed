"""Distillation against the teacher's cached top-k: the targets, the trainable set, the schedule and
one optimizer step. Shared by train_student (scales, gains and any training mode) and dtgma_cut (gates).

Loss per token: KL(teacher top-k renormalised ‖ student), the student's full-vocabulary softmax
gathered at the teacher's ids (`tail` adds the (k+1)-th bucket), computed in chunks (`losses.py`).

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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from nvg.artifacts import read_topk, read_windows
from nvg.distributed import Group
from nvg.losses import topk_kl
from nvg.model import autocast


def lr_shape(step: int, total: int) -> float:
    """Linear warm-up over max(1, total/50) steps, then cosine to zero at `total`."""
    warm = max(1, total // 50)
    if step <= warm:
        return step / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def trainable(model) -> dict[str, torch.nn.Parameter]:
    """h, ℓ, g of every BLR linear and every RMSNorm gain; everything else frozen."""
    params = {}
    for name, p in model.named_parameters():
        keep = name.endswith((".h", ".ell", ".g")) or name.endswith("norm.weight")
        p.requires_grad_(keep)
        if keep:
            params[name] = p
    return params


@dataclass
class Targets:
    """The windows and the teacher's top-k for every window; rows ≥ n_train are held out."""

    tokens: np.ndarray  # [N, window] int32
    t_ids: np.ndarray  # [N, window, k] int32
    t_logp: np.ndarray  # [N, window, k] float16
    n_train: int

    @classmethod
    def from_files(cls, windows: Path, topk: list[Path], vocab: int) -> "Targets":
        """Both checked on reading (`nvg/artifacts.py`): content hash, lineage, ranges, finiteness."""
        tokens, attrs = read_windows(windows, vocab)
        t_ids, t_logp = read_topk(topk, attrs, len(tokens), vocab)
        return cls(tokens, t_ids, t_logp, int(attrs["n_train"]))


class Distiller:
    """The student and its targets: loss, one optimizer step, held-out KL and snapshots."""

    def __init__(self, model, targets: Targets, device, *, batch: int, precision: str, tail: bool = False,
                 recompute_every: int = 0, group: Group = Group()):
        self.model, self.targets, self.device, self.group = model, targets, device, group
        self.batch_size, self.precision, self.tail = batch, precision, tail
        self.params = trainable(model)
        # memory, not results: on CUDA every k-th block is recomputed in backward; the CPU keeps all
        self.recompute_every = recompute_every if device.type == "cuda" else 0
        self.modes: list = []  # training modes, see the module docstring

    def batch(self, rows):
        t = self.targets
        pick = lambda a: torch.from_numpy(a[rows]).to(self.device)  # noqa: E731
        return pick(t.tokens), pick(t.t_ids), pick(t.t_logp)

    def loss(self, rows) -> torch.Tensor:
        """Mean per-token KL over `rows`."""
        ids, t_ids, t_logp = self.batch(rows)
        with autocast(self.device, self.precision):
            hidden = self.model.hidden(ids, self.recompute_every if torch.is_grad_enabled() else 0)
            return topk_kl(hidden, self.model.head_weight, t_ids, t_logp, self.tail) / ids.numel()

    def step(self, rows, opt, lr_factor: float, gscale: float, *, lr: float, clip: float) -> dict:
        """Forward and backward on this process's share of `rows`, gradients averaged over processes,
        then, unless the loss, the gradient norm or a mode's statistics are non-finite, one Adam update at
        lr · `lr_factor` with the global norm clipped to `clip`. Returns loss, grad_norm, lr, skipped and
        each mode's statistics under its name."""
        for mode in self.modes:
            mode.begin_step(lr_factor, gscale)
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
                param_group["lr"] = result["lr"]
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
