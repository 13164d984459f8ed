"""Stage `dtgma_cut` (optional): learn which MLP neurons matter, keep a fraction, cut the tensors exactly.

A gate σ(a/τ) on every MLP neuron (the input of down_proj; τ 0.5, a₀ 2.0) trains with Adam (lr 0.1)
on the same KL to the teacher's top-k plus an L1 pressure that starts at `l1_init` and grows at every
evaluation (l1 ← l1·l1_grow + l1_step; every `eval_every` steps, at most `max_steps`, then `settle`
steps without pressure). The held-out KL with hard gates (σ > ½) picks the best logits. Neurons are
ranked by logit; `keep` of all are kept, at least 25 % per layer, widths multiples of `align`.
The cut drops gate/up rows (BLR: rows of h and S_U) and down columns (BLR: entries of g and columns
of the stored S_V bits, re-packed) — no re-encoding.

    python -m nvg.dtgma_cut --student S.cmf --windows W.h5 --topk ... --out masked.cmf --settings JSON
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from nvg import blr as codec
from nvg.cmf import BLR, Tensor, dense_tensor, read_verified, tensor_to_numpy, write_cmf
from nvg.distill import Distiller, Targets
from nvg.errors import exits_cleanly
from nvg.model import load_model, pick_device
from nvg.settings import SETTINGS_HELP, check, load


@dataclass
class DtgmaSettings:
    """Config block `dtgma` (defaults and bounds: the schema; build with `nvg.settings.load`)."""

    SECTION: ClassVar[str] = "dtgma"
    keep: float | None  # the rule runs only when dtgma.keep is set
    lr: float
    tau: float
    init: float
    l1_init: float
    l1_step: float
    l1_grow: float
    eval_every: int
    max_steps: int
    settle: int
    align: int
    floor: float
    batch: int
    seed: int
    device: str
    precision: str

    def __post_init__(self):
        check(self.keep is not None, "dtgma", "keep", "required: the fraction of MLP neurons to keep, in (0, 1)")


def choose_widths(logits: list[np.ndarray], keep: float, align: int, floor: float) -> list[np.ndarray]:
    """Kept neuron indices per layer: the highest logits, `keep` overall, ≥ floor per layer, widths % align == 0."""
    widths = [len(x) for x in logits]
    total = round(keep * sum(widths))
    minimum = [min(w, math.ceil(floor * w / align) * align) for w in widths]
    counts = list(minimum)
    order = [np.argsort(-x, kind="stable") for x in logits]
    # the remaining budget goes to the globally best-ranked neurons beyond each layer's floor
    extra = sorted(((-logits[layer][idx], layer) for layer in range(len(logits)) for idx in order[layer][minimum[layer]:]))
    for _, layer in extra[: max(0, total - sum(minimum))]:
        counts[layer] += 1
    counts = [min(w, max(m, round(c / align) * align)) for c, w, m in zip(counts, widths, minimum)]
    return [np.sort(order[layer][: counts[layer]]) for layer in range(len(logits))]


def cut_tensor(t: Tensor, keep: np.ndarray, rows: bool) -> Tensor:
    """Keep `keep` output rows (gate/up) or input columns (down) of a dense or BLR tensor, exactly."""
    if t.dtype == BLR:
        b = codec.decode(bytes(t.data))
        factors = []
        for p in b.paths:
            su, sv = p.signs()
            if rows:
                factors.append((p.h[keep], p.g, p.ell, su[keep], sv))
            else:
                factors.append((p.h, p.g[keep], p.ell, su, sv[:, keep]))
        new = codec.BlrTensor.from_factors(factors)
        return Tensor(t.name, BLR, (new.d_out, new.d_in), new.encode())
    w = tensor_to_numpy(t)
    w = w[keep] if rows else w[:, keep]
    return dense_tensor(t.name, w, t.dtype)


def main(student: Path, windows: Path, topk: list[Path], out: Path, s: DtgmaSettings) -> None:
    torch.manual_seed(s.seed)
    device, s_cmf = pick_device(s.device), read_verified(student)
    targets = Targets.from_files(windows, topk, s_cmf.arch["vocab_size"])
    # recompute_every 1: on CUDA each block's activations are recomputed in backward (memory, not results)
    d = Distiller(load_model(s_cmf, device), targets, device, batch=s.batch, precision=s.precision, recompute_every=1)
    model, n_train = d.model, targets.n_train
    for p in model.parameters():
        p.requires_grad_(False)
    layers = model.model.layers
    widths = [(up.h.shape[-1] if hasattr(up, "h") else up.weight.shape[0]) for up in (layer.mlp.up_proj for layer in layers)]
    gates = [torch.full((w,), s.init, device=device, requires_grad=True) for w in widths]
    hard = {"on": False}

    def gate_hook(i):
        def hook(_mod, args):
            g = (gates[i] > 0).float() if hard["on"] else torch.sigmoid(gates[i] / s.tau)
            return (args[0] * g.to(args[0].dtype),)
        return hook

    hooks = [layer.mlp.down_proj.register_forward_pre_hook(gate_hook(i)) for i, layer in enumerate(layers)]
    opt = torch.optim.Adam(gates, lr=s.lr)
    n_batches = max(1, n_train // s.batch)

    def heldout_hard() -> float:
        hard["on"] = True
        try:
            return d.heldout_kl()
        finally:
            hard["on"] = False

    open_loss = d.heldout_kl()
    best = (heldout_hard(), [g.detach().clone() for g in gates], 0)
    l1, t0, step = s.l1_init, time.perf_counter(), 0
    total_neurons = sum(widths)
    for step in range(1, s.max_steps + s.settle + 1):
        b = (step - 1) % n_batches
        pressure = l1 if step <= s.max_steps else 0.0
        loss = d.loss(list(range(b * s.batch, (b + 1) * s.batch)))
        penalty = sum(torch.sigmoid(g / s.tau).sum() for g in gates) / total_neurons
        (loss + pressure * penalty).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % s.eval_every == 0 or step == s.max_steps + s.settle:
            e = heldout_hard()
            open_frac = float(sum((g > 0).sum() for g in gates)) / total_neurons
            print(f"  dtgma step {step}: KL {float(loss):.4f}, l1 {pressure:.4f}, open {open_frac:.3f}, hard held-out KL {e:.5f}", file=sys.stderr)
            if e < best[0]:
                best = (e, [g.detach().clone() for g in gates], step)
            if step <= s.max_steps:
                l1 = l1 * s.l1_grow + s.l1_step
            if open_frac < s.keep * 0.5:
                break
    for h in hooks:
        h.remove()
    keep_idx = choose_widths([g.cpu().numpy() for g in best[1]], s.keep, s.align, s.floor)
    tensors = []
    for name, t in s_cmf.tensors.items():
        parts = name.split(".")
        if len(parts) == 6 and parts[3] == "mlp" and parts[4] in ("gate_proj", "up_proj", "down_proj"):
            t = cut_tensor(t, keep_idx[int(parts[2])], rows=parts[4] != "down_proj")
        tensors.append(t)
    header = dict(s_cmf.header)
    kept = [len(k) for k in keep_idx]
    header["arch"] = {**header["arch"], "intermediate_size": max(kept)}
    header["provenance"] = {**header.get("provenance", {}), "dtgma": {
        "keep": s.keep, "widths": kept, "open_loss": open_loss, "hard_loss": best[0], "step": best[2],
        "steps": step, "sec_per_step": (time.perf_counter() - t0) / max(1, step), "settings": asdict(s)}}
    write_cmf(out, header, tensors, s_cmf.vocab)
    print(f"dtgma_cut: {sum(kept)} of {total_neurons} MLP neurons kept ({100 * sum(kept) / total_neurons:.1f} %), "
          f"widths {kept} → {out}", file=sys.stderr)


@exits_cleanly
def cli(argv=None):
    ap = argparse.ArgumentParser(prog="nvg dtgma-cut", description=__doc__.splitlines()[0])
    ap.add_argument("--student", required=True, type=Path, help="the encoded student CMF whose MLP neurons are gated and cut")
    ap.add_argument("--windows", required=True, type=Path, help="the token windows (results/data/windows.h5)")
    ap.add_argument("--topk", required=True, type=Path, nargs="+", help="the teacher's top-k shards (results/teacher/topk.*.h5)")
    ap.add_argument("--out", required=True, type=Path, help="the cut student CMF")
    ap.add_argument("--settings", required=True, help=SETTINGS_HELP)
    a = ap.parse_args(argv)
    main(a.student, a.windows, a.topk, a.out, load(DtgmaSettings, a.settings))


if __name__ == "__main__":
    cli()
