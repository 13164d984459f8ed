"""Stage `train_student`: distil the BLR metric (h, ℓ, g of every path) and the RMSNorm gains.

Loss per token: KL(teacher top-k renormalised ‖ student), the student's full-vocabulary softmax
gathered at the teacher's ids (`tail: true` adds the (k+1)-th bucket), computed in chunks. Adam
(0.9, 0.999, 1e-8), linear warm-up over max(1, steps/50) then cosine to zero over the whole run (even
when `stop_after` ends it early), global-norm clipping, bf16 autocast (fp16 mode: dynamic gradient
scale from 4096, halved on a non-finite step); a non-finite step is skipped, counted and logged.
Held-out KL before training, every `eval_every` steps and at the end; the best snapshot is restored.

Resume: every `state_every` steps the whole state (one dict: parameters, Adam moments, best
snapshot, counters, epoch and batch position, eval and metric logs) is written atomically to
`<state_root>/<key>/state.pt`, key = hash of the inputs and settings. Rerunning resumes from it; the
batch order is a pure function of (seed, epoch), so a resumed run ends bit-identical (CPU).

    python -m nvg.train_student --student S.cmf --windows W.h5 --topk topk.0.h5 ... \
        --out trained.cmf --metrics metrics.jsonl --settings JSON
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from nvg import distributed
from nvg.atomic import atomic_path
from nvg.distributed import Group
from nvg.cmf import BLR, F16, Tensor, dense_tensor, read_cmf, write_cmf
from nvg.errors import NvgError, exits_cleanly
from nvg.hash64 import hash64, hex16
from nvg.losses import topk_kl
from nvg.model import autocast, compile_blocks, load_model, pick_device
from nvg.settings import check, from_json
from nvg.sign_training import SignSettings, SignTrainer
from nvg.teacher_topk import read_topk
from nvg.tokenize_windows import read_windows


@dataclass
class TrainSettings:
    epochs: int = 2
    batch: int = 4
    lr: float = 1e-3
    clip: float = 1.0
    eval_every: int = 8
    state_every: int = 4
    stop_after: int | None = None
    tail: bool = False
    precision: str = "bf16"
    seed: int = 1234
    device: str = "auto"
    gpus: int = 1
    recompute_every: int = 1
    state_root: str = "results/state/train_student"
    signs: dict | SignSettings = field(default_factory=dict)

    def __post_init__(self):
        check(self.epochs >= 1, "train", "epochs", f"must be >= 1, got {self.epochs}")
        check(self.batch >= 1, "train", "batch", f"must be >= 1, got {self.batch}")
        check(self.lr > 0, "train", "lr", f"must be > 0, got {self.lr}")
        check(self.clip > 0, "train", "clip", f"must be > 0, got {self.clip}")
        check(self.eval_every >= 1, "train", "eval_every", f"must be >= 1, got {self.eval_every}")
        check(self.state_every >= 0, "train", "state_every", f"must be >= 0, got {self.state_every}")
        check(self.stop_after is None or self.stop_after >= 1, "train", "stop_after", f"must be >= 1 or null, got {self.stop_after}")
        check(self.precision in ("bf16", "fp16", "fp32"), "train", "precision", f"bf16, fp16 or fp32, got {self.precision!r}")
        check(self.recompute_every >= 0, "train", "recompute_every", f"must be >= 0, got {self.recompute_every}")
        check(self.gpus >= 1 and self.batch % self.gpus == 0, "train", "gpus",
              f"must be >= 1 and divide train.batch {self.batch}, got {self.gpus}")
        if isinstance(self.signs, dict):
            self.signs = from_json(SignSettings, self.signs, "train.signs")


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


def state_key(inputs: list[Path], settings: TrainSettings) -> str:
    """Names the state folder: any change of an input file or a result-affecting setting gives a new one."""
    parts = [f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in inputs]
    s = {k: v for k, v in asdict(settings).items() if k not in ("device", "gpus", "state_root", "stop_after", "recompute_every")}
    return hex16(hash64(json.dumps([parts, s], sort_keys=True).encode()))


class Distiller:
    """The student, its batches and the teacher's targets, with loss, eval and snapshot helpers."""

    def __init__(self, model, tokens, t_ids, t_logp, n_train, settings: TrainSettings, device, group=Group()):
        self.model, self.s, self.device, self.group = model, settings, device, group
        self.tokens, self.t_ids, self.t_logp = tokens, t_ids, t_logp
        self.n_train = n_train
        self.params = trainable(model)
        # memory, not results: on CUDA every k-th block is recomputed in backward; the CPU keeps all
        self.recompute_every = settings.recompute_every if device.type == "cuda" else 0
        self.signs: SignTrainer | None = None  # set by main when train.signs.enabled

    @classmethod
    def from_files(cls, student: Path, windows: Path, topk: list[Path], settings: TrainSettings, group=Group()):
        """(Distiller, student CMF): the student on its device, the windows and the teacher's top-k."""
        tokens, attrs = read_windows(windows)
        t_ids, t_logp = read_topk(topk, len(tokens))
        device = group.device(pick_device(settings.device))
        s_cmf = read_cmf(student)
        return cls(load_model(s_cmf, device), tokens, t_ids, t_logp, int(attrs["n_train"]), settings, device, group), s_cmf

    def batch(self, rows):
        pick = lambda a: torch.from_numpy(a[rows]).to(self.device)  # noqa: E731
        return pick(self.tokens), pick(self.t_ids), pick(self.t_logp)

    def loss(self, rows) -> torch.Tensor:
        """Mean per-token KL over this process's `rows`."""
        ids, t_ids, t_logp = self.batch(rows)
        with autocast(self.device, self.s.precision):
            hidden = self.model.hidden(ids, self.recompute_every if torch.is_grad_enabled() else 0)
            return topk_kl(hidden, self.model.head_weight, t_ids, t_logp, self.s.tail) / ids.numel()

    def step(self, rows, opt, lr_factor: float, gscale: float) -> dict:
        """Forward and backward on this process's share of `rows`, gradients averaged over processes,
        then, unless the loss, the gradient norm or a sign gradient is non-finite, one clipped Adam update
        at lr · `lr_factor`. Returns loss, grad_norm, lr, skipped, signs (the sign step's statistics)."""
        if self.signs:  # the sign latents move inside this backward pass
            self.signs.begin_step(lr_factor, gscale)
        loss = self.loss(self.group.shard(rows))
        (loss * gscale).backward()
        sign_step = self.signs.end_step() if self.signs else None
        loss = float(self.group.sum(loss.detach().float()) / self.group.world)
        grads = [p.grad for p in self.params.values()]
        self.group.average_grads(grads)
        torch._foreach_div_(grads, gscale)
        gn = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
        bad_signs = sign_step["nonfinite"] if sign_step else 0
        result = {"loss": loss, "grad_norm": gn, "lr": self.s.lr * lr_factor, "signs": sign_step, "bad_signs": bad_signs,
                  "skipped": not (math.isfinite(gn) and math.isfinite(loss)) or bad_signs > 0}
        if not result["skipped"]:
            for param_group in opt.param_groups:
                param_group["lr"] = result["lr"]
            if gn > self.s.clip:
                torch._foreach_mul_(grads, self.s.clip / gn)
            opt.step()
        opt.zero_grad(set_to_none=True)
        return result

    @torch.no_grad()
    def heldout_kl(self) -> float:
        rows = list(range(self.n_train, len(self.tokens)))
        mine = self.group.shard(rows)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for s in range(0, len(mine), self.s.batch):
            total += self.loss(mine[s : s + self.s.batch]).double() * len(mine[s : s + self.s.batch])
        return float(self.group.sum(total)) / len(rows)

    def snapshot(self) -> dict:
        """The trained values (and the bits, with sign training): what the best checkpoint keeps."""
        snap = {n: p.detach().cpu().clone() for n, p in self.params.items()}
        if self.signs:
            snap["sign_bits"] = self.signs.bits()
        return snap

    @torch.no_grad()
    def restore(self, snap: dict) -> None:
        for n, p in self.params.items():
            p.copy_(snap[n].to(p.device))
        if self.signs:
            self.signs.restore_bits(snap["sign_bits"])


def export_student(student_cmf, model, out: Path, provenance_block: dict) -> None:
    """A copy of the student with the trained payload values: same tensors, shapes, dtypes and sizes."""
    blr = model.blr_linears()
    gains = model.norm_gains()
    tensors = []
    for name, t in student_cmf.tensors.items():
        if name in blr and t.dtype == BLR:
            data = blr[name].to_payload().encode()
        elif name in gains and t.dtype == F16:
            data = dense_tensor(name, gains[name].detach().cpu().numpy(), F16).data
        else:
            data = t.data
        if len(data) != len(t.data):
            raise NvgError(f"{name}: exported payload is {len(data)} bytes, the student's is {len(t.data)}")
        tensors.append(Tensor(name, t.dtype, t.shape, data))
    header = dict(student_cmf.header)
    header["provenance"] = {**header.get("provenance", {}), "nvg_train": provenance_block}
    write_cmf(out, header, tensors, student_cmf.vocab)


def main(student: Path, windows: Path, topk: list[Path], teacher_name: str, out: Path, metrics: Path,
         settings: TrainSettings) -> None:
    s = settings
    torch.manual_seed(s.seed)
    group = distributed.start(pick_device(s.device))
    say = (lambda *a, **k: print(*a, **k, file=sys.stderr)) if group.main else (lambda *a, **k: None)  # noqa: E731
    if group.world != s.gpus:
        raise NvgError(f"config train.gpus: {s.gpus}, but {group.world} processes were started (torchrun --nproc_per_node)")
    d, s_cmf = Distiller.from_files(student, windows, topk, s, group)
    model, tokens, n_train, device = compile_blocks(d.model), d.tokens, d.n_train, d.device
    if not d.params:
        raise NvgError(f"{student}: no trainable tensors (no BLR linears and no norm gains)")
    n_batches = n_train // s.batch
    if n_batches < 1:
        raise NvgError(f"config train.batch: {s.batch} exceeds the {n_train} training windows")
    total = n_batches * s.epochs
    opt = torch.optim.Adam(list(d.params.values()), lr=s.lr, betas=(0.9, 0.999), eps=1e-8, fused=device.type == "cuda")
    if s.signs.enabled:
        d.signs = SignTrainer(model, s.signs, total, group)
        say(d.signs.describe())
    state_dir = Path(s.state_root) / state_key([student, windows, *topk], s)
    state_file = state_dir / "state.pt"
    if state_file.exists():
        st = torch.load(state_file, map_location="cpu", weights_only=False)
        d.restore(st["params"])
        opt.load_state_dict(st["adam"])
        if d.signs:
            d.signs.load_state_dict(st["signs"])
        say(f"train_student: resumed {state_file} at step {st['done']} (epoch {st['epoch']}, batch {st['pos']})")
    else:
        e0 = d.heldout_kl()
        st = {"done": 0, "epoch": 0, "pos": 0, "skipped": 0, "gscale": 4096.0 if s.precision == "fp16" else 1.0,
              "e0": e0, "best_kl": e0, "best_step": 0, "best": d.snapshot(), "evals": [{"step": 0, "heldout_kl": e0}],
              "metrics": [{"step": 0, "heldout_kl": e0}], "tokens_seen": 0}
    say(f"train_student: {len(d.params)} trainable tensors, {n_batches} batches × {s.epochs} epochs = {total} steps, "
        f"held-out KL before training {st['e0']:.5f}, device {device}" + (f" × {group.world} processes" if group.world > 1 else ""))
    done0, t0 = st["done"], time.perf_counter()
    stop = s.stop_after or total
    for epoch in range(st["epoch"], s.epochs):
        if st["done"] >= stop:
            break
        order = torch.randperm(n_batches, generator=torch.Generator().manual_seed(s.seed + epoch)).tolist()
        first = st["pos"] if epoch == st["epoch"] else 0
        for pos in range(first, n_batches):
            if st["done"] >= stop:
                break
            rows = list(range(order[pos] * s.batch, (order[pos] + 1) * s.batch))
            result = d.step(rows, opt, lr_shape(st["done"] + 1, total), st["gscale"])
            loss, gn, sign_step = result["loss"], result["grad_norm"], result["signs"]
            st["epoch"], st["pos"] = epoch, pos + 1
            if result["skipped"]:
                st["skipped"] += 1
                if s.precision == "fp16":
                    st["gscale"] = max(1.0, st["gscale"] / 2)
                say(f"\n  non-finite step (loss {loss:.4f}, |g| {gn:.3e}, {result['bad_signs']} non-finite sign gradients): "
                    f"skipped, gscale {st['gscale']}")
                st["metrics"].append({"step": st["done"], "skipped": True})
                continue
            st["done"] += 1
            lr = result["lr"]
            st["tokens_seen"] += len(rows) * tokens.shape[1]
            elapsed = time.perf_counter() - t0
            per_step = elapsed / max(1, st["done"] - done0)
            tok_s = (st["done"] - done0) * s.batch * tokens.shape[1] / max(elapsed, 1e-9)
            record = {"step": st["done"], "loss": loss, "grad_norm": gn, "lr": lr, "tok_s": tok_s}
            sign_note = ""
            if sign_step:
                record.update(sign_eta=sign_step["eta"], sign_flips=sign_step["flips"])
                sign_note = f"  η {sign_step['eta']:.2e} flips {sign_step['flips']} ({sign_step['flip_rate']:.1e})"
            st["metrics"].append(record)
            say(f"  epoch {epoch + 1} step {st['done']}/{total}  loss {loss:.4f}  |g| {gn:.3e}  lr {lr:.2e}{sign_note}  "
                f"{per_step:.2f} s/step  {tok_s:.0f} tok/s  ETA {per_step * (min(stop, total) - st['done']):.0f}s")
            if sign_step and (note := d.signs.flip_guard(sign_step)):
                say(f"  {note}")
            if st["done"] % s.eval_every == 0 or st["done"] == total:
                e = d.heldout_kl()
                evaluation = {"step": st["done"], "heldout_kl": e}
                say(f"  step {st['done']}: held-out KL {e:.5f} (best {min(e, st['best_kl']):.5f} at "
                    f"{st['done'] if e < st['best_kl'] else st['best_step']})")
                if d.signs:
                    fields, lines = d.signs.after_eval(e, st["best_kl"])
                    evaluation.update(fields)
                    for line in lines:
                        say(f"    {line}")
                if e < st["best_kl"]:
                    st["best_kl"], st["best_step"], st["best"] = e, st["done"], d.snapshot()
                st["evals"].append(evaluation)
                st["metrics"].append(evaluation)
            if s.state_every and st["done"] % s.state_every == 0 and st["done"] < total and group.main:
                state_dir.mkdir(parents=True, exist_ok=True)
                with atomic_path(state_file) as tmp:
                    torch.save({**st, "params": d.snapshot(), "adam": opt.state_dict(),
                                "signs": d.signs.state_dict() if d.signs else None}, tmp)
                say(f"  state saved at step {st['done']}: {state_file}")
    d.restore(st["best"])
    say(f"train_student: best held-out KL {st['best_kl']:.5f} at step {st['best_step']} (start {st['e0']:.5f}); "
        f"{st['skipped']} non-finite steps skipped; {st['done']} steps")
    if not group.main:  # process 0 writes the outputs
        distributed.stop(group)
        return
    export_student(s_cmf, model, out, {
        "teacher": teacher_name, "tokens": st["tokens_seen"], "window": int(tokens.shape[1]), "batch": s.batch,
        "lr": s.lr, "topk": int(d.t_ids.shape[-1]), "steps": st["done"], "best_step": st["best_step"],
        "heldout_kl_start": st["e0"], "heldout_kl_best": st["best_kl"], "skipped": st["skipped"],
        "tail": s.tail, "precision": s.precision, "processes": group.world, "evals": st["evals"],
        **({"signs": d.signs.provenance()} if d.signs else {}),
    })
    with atomic_path(metrics) as tmp:
        tmp.write_text("".join(json.dumps(m) + "\n" for m in st["metrics"]))
    if st["done"] >= total and state_dir.exists():  # finished: the outputs now hold everything the state did
        shutil.rmtree(state_dir)
    distributed.stop(group)


@exits_cleanly
def cli(argv=None):
    ap = argparse.ArgumentParser(prog="nvg train-student", description=__doc__.splitlines()[0])
    ap.add_argument("--student", required=True, type=Path)
    ap.add_argument("--windows", required=True, type=Path)
    ap.add_argument("--topk", required=True, type=Path, nargs="+")
    ap.add_argument("--teacher-name", default="teacher.cmf")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--metrics", required=True, type=Path)
    ap.add_argument("--settings", required=True)
    a = ap.parse_args(argv)
    main(a.student, a.windows, a.topk, a.teacher_name, a.out, a.metrics, from_json(TrainSettings, a.settings, "train"))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    cli()
