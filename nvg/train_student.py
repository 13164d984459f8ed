"""Stage `train_student`: distil the BLR metric (h, ℓ, g of every path), the RMSNorm gains and, when the
embedding or LM head is group-scaled (q8_row, q4_block, q4tp, q2tp), their group scales (at
`group_scale_lr` × lr) and, with `group_code_lr`, their codes through straight-through latents; with
`embedding_lr`, a dense (f16) embedding and LM head whole.

setup → fit → finish. The loss and the optimizer step are `nvg/distill.py`'s: KL to the teacher's
top-k, Adam (0.9, 0.999, 1e-8; with `lr_relative` each tensor's step is scaled by its starting RMS), linear warm-up over max(1, steps/50) then cosine (or, `lr_decay: linear`, straight) to zero over the
whole run (even when `stop_after` ends it early; with `hidden_decay` the live teacher's hidden-state term
follows the same shape; with `hidden_epochs` it ends after that many epochs, and where the teacher's final hidden
states fit in `teacher_memo_gb` the teacher then runs no more), global-norm clipping, bf16 autocast (fp16 mode:
dynamic gradient scale from 4096, halved on a non-finite step); a non-finite step is skipped, counted
and logged. Held-out KL before training, every `eval_every` steps and at the end; the best snapshot is
restored. Training modes (`train.signs`) plug into the step and the evaluations through hooks.

Resume: every `state_every` steps, and at the step under way on SIGINT or SIGTERM, the `RunState`
(parameters, Adam moments, best snapshot, each mode's state, counters, epoch and batch position, eval and
metric logs) is written atomically to
`<state_root>/<key>/state.safetensors`, key = hash of the inputs and settings. Tensors and JSON only:
nothing is unpickled. Rerunning resumes from it; the batch order is a pure function of (seed, epoch),
so a resumed run ends bit-identical (CPU).

    python -m nvg.train_student --student S.cmf --windows W.h5 --topk topk.0.h5 ... \
        --out trained.cmf --metrics metrics.jsonl --settings JSON
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, ClassVar

import torch

from nvg import distributed, fp8
from nvg.adam import OnePassAdam
from nvg.artifacts import check_encoded_from, encoded_from
from nvg.atomic import atomic_path
from nvg.cmf import CmfFile, read_verified
from nvg.distill import Distiller, Targets, lr_shape, param_groups
from nvg.distributed import Group
from nvg.errors import NvgError, exits_cleanly
from nvg.model import compile_blocks, compute_precision, computing_in, load_model, pick_device, write_student
from nvg.resume import load_state, one_run, save_state, state_file, stop_requests
from nvg.settings import SETTINGS_HELP, check, load
from nvg.sign_training import SignSettings, SignTrainer, sign_reference


@dataclass
class TrainSettings:
    """Config block `train` (defaults and bounds: the schema; build with `nvg.settings.load`)."""

    SECTION: ClassVar[str] = "train"
    epochs: int
    batch: int
    lr: float
    lr_relative: bool
    lr_decay: str
    group_scale_lr: float
    group_code_lr: float
    embedding_lr: float
    adam_beta2: float
    clip: float
    eval_every: int
    state_every: int
    stop_after: int | None
    targets: str
    hidden_weight: float
    hidden_decay: bool
    hidden_epochs: int | None
    teacher_memo_gb: float
    tail: bool
    precision: str
    seed: int
    device: str
    gpus: int
    recompute_every: int
    cuda_graphs: bool
    fp8: bool
    state_root: str
    signs: SignSettings

    def __post_init__(self):
        check(self.batch % self.gpus == 0, "train", "gpus", f"must divide train.batch {self.batch}, got {self.gpus}")
        check(self.gpus == 1 or ":" not in self.device, "train", "device",
              f"{self.device} names one GPU, but train.gpus {self.gpus} runs one process on each GPU it sees: use auto or cuda")
        check(self.targets == "live" or self.signs.init == "uniform", "train", "signs.init",
              "margin needs targets: live (the margins come from the live teacher's weights)")
        check(self.targets == "topk" or not self.tail, "train", "tail", "applies to targets: topk only (live targets have the whole vocabulary)")
        check(not self.fp8 or self.precision == "bf16", "train", "fp8", f"needs train.precision bf16 (the fp8 GEMMs write bf16), got {self.precision}")


def state_settings(settings: TrainSettings) -> dict:
    """The settings that change the result (what names the state folder besides the inputs); hidden_weight,
    hidden_decay and hidden_epochs only with the live teacher, the cached top-k having no hidden states."""
    unread = ("device", "gpus", "state_root", "stop_after", "recompute_every", "cuda_graphs", "teacher_memo_gb") + (
        () if settings.targets == "live" else ("hidden_weight", "hidden_decay", "hidden_epochs"))
    return {k: v for k, v in asdict(settings).items() if k not in unread}


@dataclass
class RunState:
    """What training changes and a resumed run restores. Saved as one safetensors file: the tensors
    (current and best values, Adam moments, each mode's state) with these counters and logs as JSON in
    its metadata, so loading it can run no code."""

    e0: float  # held-out KL before training
    best_kl: float
    best: dict[str, torch.Tensor]  # the snapshot at best_step
    done: int = 0
    epoch: int = 0
    pos: int = 0  # next batch of `epoch`
    skipped: int = 0
    gscale: float = 1.0
    best_step: int = 0
    tokens_seen: int = 0
    evals: list = field(default_factory=list)
    metrics: list = field(default_factory=list)

    def counters(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "best"}

    def save(self, path: Path, d: Distiller, opt: torch.optim.Optimizer) -> None:
        adam = opt.state_dict()
        tensors = {f"current/{k}": v for k, v in d.snapshot().items()}
        tensors.update({f"best/{k}": v for k, v in self.best.items()})
        tensors.update({f"adam/{i}/{k}": v for i, st in adam["state"].items() for k, v in st.items()})
        modes = {}
        for mode in d.modes:
            mode_tensors, modes[mode.name] = mode.state()
            tensors.update({f"mode/{mode.name}/{k}": v for k, v in mode_tensors.items()})
        save_state(path, tensors, {"run": self.counters(), "adam_groups": adam["param_groups"],
                                   "adam_state": {str(i): sorted(st) for i, st in adam["state"].items()}, "modes": modes})

    @classmethod
    def load(cls, path: Path, d: Distiller, opt: torch.optim.Optimizer) -> "RunState":
        def restore(tensors: dict[str, torch.Tensor], meta: dict) -> "RunState":
            part = lambda prefix: {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}  # noqa: E731
            d.restore(part("current/"))
            opt.load_state_dict({
                "state": {int(i): {k: tensors[f"adam/{i}/{k}"] for k in keys} for i, keys in meta["adam_state"].items()},
                "param_groups": [{**g, "betas": tuple(g["betas"])} for g in meta["adam_groups"]]})
            for mode in d.modes:
                mode.load_state(part(f"mode/{mode.name}/"), meta["modes"][mode.name])
            return cls(best=part("best/"), **meta["run"])
        return load_state(path, "training", restore)


@dataclass
class Run:
    """What setup builds and fit and finish use."""

    settings: TrainSettings
    group: Group
    d: Distiller
    opt: torch.optim.Optimizer
    student: CmfFile
    state: RunState
    state_file: Path
    lock: contextlib.ExitStack  # `resume.one_run` on state_file, released when the run is done with it
    n_batches: int
    total: int
    say: Callable


def live_teacher(t_cmf: CmfFile, student: CmfFile, device):
    """The teacher as a frozen model beside the student, after checking that the student was encoded
    from it (the teacher hash the encoder recorded) and has its shape."""
    check_encoded_from(student, t_cmf)
    model = compile_blocks(load_model(t_cmf, device))
    model.requires_grad_(False)
    return model


def setup(student: Path, windows: Path, topk: list[Path], s: TrainSettings, teacher: Path | None = None,
          grams: Path | None = None) -> Run:
    """The student on its device, its targets (the top-k files, or the live `teacher`), the optimizer,
    the training modes (sign training's `init: margin` reads the teacher's `grams`), and the run state:
    resumed from `state_root` when a state for these inputs and settings exists."""
    torch.manual_seed(s.seed)
    requested = pick_device(s.device)
    group = distributed.start(requested)  # after pick_device: under torchrun, each process's own GPU is the current one
    say = (lambda *a, **k: print(*a, **k, file=sys.stderr)) if group.main else (lambda *a, **k: None)  # noqa: E731
    if group.world != s.gpus:
        raise NvgError(f"config train.gpus: {s.gpus}, but {group.world} processes were started (torchrun --nproc_per_node)")
    s_cmf = read_verified(student)
    live = s.targets == "live"
    if live != (teacher is not None) or live == bool(topk):
        raise NvgError(f"config train.targets: {s.targets} needs {'--teacher and no --topk' if live else '--topk files and no --teacher'}")
    margin = s.signs.margin
    s.signs.check_grams_given(grams)
    targets = Targets.from_files(windows, topk, s_cmf.arch["vocab_size"])
    if targets.topk is not None:
        targets.topk.check_teacher(encoded_from(s_cmf), f"{student} was encoded from teacher")
    device = group.device(requested)
    check(not s.fp8 or fp8.has_fp8_matmuls(device), "train", "fp8",
          f"needs a CUDA GPU with fp8 tensor cores (compute capability 8.9 or newer); this run is on {device}")
    t_cmf = read_verified(teacher) if live else None
    model = load_model(s_cmf, device)
    if s.embedding_lr > 0 and not model.dense_vocab():
        raise NvgError(f"config train.embedding_lr: {s.embedding_lr}, but {student}'s embedding and LM head are not dense "
                       "(quantised ones train their group scales: train.group_scale_lr)")
    if s.fp8:
        for name, m in model.blr_linears().items():
            check(m.h.shape[1] % fp8.ALIGNMENT == 0 and m.g.shape[1] % fp8.ALIGNMENT == 0, "train", "fp8",
                  f"{student}: {name} is {m.h.shape[1]} × {m.g.shape[1]}; fp8 GEMMs need both sides divisible by {fp8.ALIGNMENT}")
            m.fp8 = True
    if s.group_code_lr > 0:
        for g in model.group_codes().values():
            g.train_codes()
    d = Distiller(compile_blocks(model, "reduce-overhead" if s.cuda_graphs else None), targets, device, batch=s.batch, precision=s.precision,
                  tail=s.tail, recompute_every=s.recompute_every, group=group,
                  teacher=live_teacher(t_cmf, s_cmf, device) if live else None, hidden_weight=s.hidden_weight if live else 0.0,
                  hidden_decay=live and s.hidden_decay, kl_alone_ahead=live and s.hidden_weight > 0 and kl_alone_epochs(s) > 0,
                  train_group_scales=s.group_scale_lr > 0, train_dense_vocab=s.embedding_lr > 0,
                  teacher_memo_bytes=int(s.teacher_memo_gb * 2**30))
    if not d.params:
        raise NvgError(f"{student}: no trainable tensors (no BLR linears and no norm gains)")
    say(f"train_student: {computing_in(device, 'train.precision', s.precision)}")
    n_batches = targets.n_train // s.batch
    if n_batches < 1:
        raise NvgError(f"config train.batch: {s.batch} exceeds the {targets.n_train} training windows")
    total = n_batches * s.epochs
    name_of = {id(p): name for name, p in d.params.items()}
    multiplier = {name_of[id(p)]: s.group_scale_lr for p in d.model.group_scales().values() if id(p) in name_of}
    code_step = {name_of[id(g.latent)]: float(g.code_range[2]) for g in d.model.group_codes().values() if g.latent is not None}
    multiplier |= dict.fromkeys(code_step, s.group_code_lr)
    multiplier |= {name_of[id(p)]: s.embedding_lr for p in d.model.dense_vocab().values() if id(p) in name_of}
    opt = OnePassAdam(param_groups(d.params, s.lr_relative, multiplier, code_step), lr=s.lr, betas=(0.9, s.adam_beta2), eps=1e-8)
    if s.signs.enabled:
        d.modes.append(SignTrainer(d.model.blr_linears(), s.signs, total, group, reference=sign_reference(grams, t_cmf, d.teacher) if margin else None))
    for mode in d.modes:
        say(mode.describe())
    state_path = state_file(s.state_root, [student, windows, *topk, *([teacher] if live else []), *([grams] if grams else [])], state_settings(s))
    with contextlib.ExitStack() as held:
        if group.main:  # the process that saves the state holds it until finish
            held.enter_context(one_run(state_path, "training"))
        if state_path.exists():
            st = RunState.load(state_path, d, opt)
            say(f"train_student: resumed {state_path} at step {st.done} (epoch {st.epoch}, batch {st.pos})")
        else:
            e0 = d.heldout_kl()
            st = RunState(e0=e0, best_kl=e0, best=d.snapshot(), gscale=4096.0 if s.precision == "fp16" else 1.0,
                          evals=[{"step": 0, "heldout_kl": e0}], metrics=[{"step": 0, "heldout_kl": e0}])
        lock = held.pop_all()
    say(f"train_student: {len(d.params)} trainable tensors, {n_batches} batches × {s.epochs} epochs = {total} steps, "
        f"held-out KL before training {st.e0:.5f}, device {device}" + (f" × {group.world} processes" if group.world > 1 else ""))
    return Run(s, group, d, opt, s_cmf, st, state_path, lock, n_batches, total, say)


def evaluate(run: Run) -> None:
    """Held-out KL now; the modes' statistics and guards; the best snapshot kept."""
    st, d, say = run.state, run.d, run.say
    e = d.heldout_kl()
    evaluation = {"step": st.done, "heldout_kl": e}
    say(f"  step {st.done}: held-out KL {e:.5f} (best {min(e, st.best_kl):.5f} at {st.done if e < st.best_kl else st.best_step})")
    for mode in d.modes:
        mode_fields, lines = mode.after_eval(e, st.best_kl)
        evaluation.update(mode_fields)
        for line in lines:
            say(f"    {line}")
    if e < st.best_kl:
        st.best_kl, st.best_step, st.best = e, st.done, d.snapshot()
    st.evals.append(evaluation)
    st.metrics.append(evaluation)


def fit(run: Run) -> None:
    """Steps until `total` (or `stop_after`): one batch each, in a seeded order per epoch; evaluations
    every `eval_every` steps and a saved state every `state_every`. SIGINT or SIGTERM ends the step under
    way, saves the state and stops with one line: a rerun resumes with nothing lost. Under torchrun (which
    passes a SIGTERM on to every process) the processes agree after each step whether any got one, so all
    stop at the same step, and process 0 has saved before any exits."""
    with stop_requests() as signals:
        _fit(run, signals)


def _fit(run: Run, signals: list[int]) -> None:
    s, st, d, say = run.settings, run.state, run.d, run.say
    window = d.targets.tokens.shape[1]
    done0, t0 = st.done, time.perf_counter()
    stop = s.stop_after or run.total
    for epoch in range(st.epoch, s.epochs):
        if st.done >= stop:
            break
        if d.hidden_on and s.hidden_epochs is not None and epoch >= s.hidden_epochs:
            d.hidden_on = False
            say(f"  epoch {epoch + 1}: the KL alone from here (train.hidden_epochs {s.hidden_epochs})"
                + ("; the teacher's final hidden states are read back, not run again" if d.keeps_teacher_hidden() else ""))
        order = torch.randperm(run.n_batches, generator=torch.Generator().manual_seed(s.seed + epoch)).tolist()
        first = st.pos if epoch == st.epoch else 0
        for pos in range(first, run.n_batches):
            if st.done >= stop:
                break
            rows = list(range(order[pos] * s.batch, (order[pos] + 1) * s.batch))
            if pos + 1 < run.n_batches:
                d.prefetch(range(order[pos + 1] * s.batch, (order[pos + 1] + 1) * s.batch))
            result = d.step(rows, run.opt, lr_shape(st.done + 1, run.total, s.lr_decay), st.gscale, lr=s.lr, clip=s.clip)
            loss, gn = result["loss"], result["grad_norm"]
            st.epoch, st.pos = epoch, pos + 1
            if result["skipped"]:
                st.skipped += 1
                if s.precision == "fp16":
                    st.gscale = max(1.0, st.gscale / 2)
                say(f"\n  non-finite step (loss {loss:.4f}, |g| {gn:.3e}, {result['nonfinite_modes']} non-finite mode "
                    f"statistics): skipped, gscale {st.gscale}")
                st.metrics.append({"step": st.done, "skipped": True})
                continue
            st.done += 1
            st.tokens_seen += len(rows) * window
            elapsed = time.perf_counter() - t0
            per_step = elapsed / max(1, st.done - done0)
            tok_s = (st.done - done0) * s.batch * window / max(elapsed, 1e-9)
            record = {"step": st.done, "loss": loss, "grad_norm": gn, "lr": result["lr"], "tok_s": tok_s}
            notes, lines = "", []
            for mode in d.modes:
                mode_fields, note, mode_lines = mode.after_step(result["modes"][mode.name])
                record.update(mode_fields)
                notes += note
                lines += mode_lines
            st.metrics.append(record)
            say(f"  epoch {epoch + 1} step {st.done}/{run.total}  loss {loss:.4f}  |g| {gn:.3e}  lr {result['lr']:.2e}{notes}  "
                f"{per_step:.2f} s/step  {tok_s:.0f} tok/s  ETA {per_step * (min(stop, run.total) - st.done):.0f}s")
            for line in lines:
                say(f"  {line}")
            if st.done % s.eval_every == 0 or st.done == run.total:
                evaluate(run)
            if s.state_every and st.done % s.state_every == 0 and st.done < run.total and run.group.main:
                st.save(run.state_file, d, run.opt)
                say(f"  state saved at step {st.done}: {run.state_file}")
            if run.group.any(bool(signals), d.device) and st.done < run.total:
                if run.group.main:
                    st.save(run.state_file, d, run.opt)
                run.group.barrier()
                what = signal.Signals(signals[0]).name if signals else "a signal to another process"
                raise NvgError(f"{run.state_file}: {what} at step {st.done} of {run.total}; the state is saved, rerun to resume")


def kl_alone_epochs(s: TrainSettings) -> int:
    """The epochs at the end that train on the KL alone (`train.hidden_epochs`)."""
    return 0 if s.hidden_epochs is None else max(0, s.epochs - s.hidden_epochs)


def codes_changed(model) -> dict[str, float]:
    """The fraction of each quantised embedding's / head's codes that training moved off the encoder's."""
    return {name: float((g.current_codes() != g.codes).float().mean()) for name, g in model.group_codes().items()}


def finish(run: Run, teacher_name: str, out: Path, metrics: Path) -> None:
    """The best snapshot restored and written (process 0), the metrics log, the finished state removed."""
    s, st, d = run.settings, run.state, run.d
    d.restore(st.best)
    run.say(f"train_student: best held-out KL {st.best_kl:.5f} at step {st.best_step} (start {st.e0:.5f}); "
            f"{st.skipped} non-finite steps skipped; {st.done} steps"
            # what a second run beside this one on the same GPU has left (bench/ablation.sh runs chains side by side)
            + (f"; peak GPU memory {torch.cuda.max_memory_allocated(d.device) / 2**30:.1f} GiB" if d.device.type == "cuda" else ""))
    if run.group.main:
        write_student(run.student, d.model, out, "nvg_train", {
            "teacher": teacher_name, "windows_hash": d.targets.windows_hash, "tokens": st.tokens_seen, "window": int(d.targets.tokens.shape[1]), "batch": s.batch,
            "lr": s.lr, "lr_relative": s.lr_relative, "group_scale_lr": s.group_scale_lr, "group_code_lr": s.group_code_lr, "embedding_lr": s.embedding_lr, "adam_beta2": s.adam_beta2,
            **({"group_codes_changed": codes_changed(d.model)} if s.group_code_lr > 0 else {}), "targets": s.targets, "steps": st.done,
            **({"hidden_weight": s.hidden_weight, "hidden_decay": s.hidden_decay, "hidden_epochs": s.hidden_epochs}
               if s.targets == "live" else {"topk": d.targets.topk.k}), "best_step": st.best_step,
            "heldout_kl_start": st.e0, "heldout_kl_best": st.best_kl, "skipped": st.skipped,
            "tail": s.tail, "precision": s.precision, "computed_in": compute_precision(d.device, s.precision), "processes": run.group.world, "evals": st.evals,
            **{mode.name: mode.provenance() for mode in d.modes},
        })
        with atomic_path(metrics) as tmp:
            tmp.write_text("".join(json.dumps(m) + "\n" for m in st.metrics))
        if st.done >= run.total and run.state_file.parent.exists():  # finished: the outputs hold everything the state did
            shutil.rmtree(run.state_file.parent)
    distributed.stop(run.group)


def main(student: Path, windows: Path, topk: list[Path], teacher_name: str, out: Path, metrics: Path,
         settings: TrainSettings, teacher: Path | None = None, grams: Path | None = None) -> None:
    run = setup(student, windows, topk, settings, teacher, grams)
    with run.lock:
        fit(run)
        finish(run, teacher_name, out, metrics)


@exits_cleanly
def cli(argv=None):
    ap = argparse.ArgumentParser(prog="nvg train-student", description=__doc__.splitlines()[0])
    ap.add_argument("--student", required=True, type=Path, help="the encoded student CMF")
    ap.add_argument("--windows", required=True, type=Path, help="the token windows (results/data/windows.h5)")
    ap.add_argument("--topk", type=Path, nargs="+", default=[], help="the cached targets (train.targets: topk)")
    ap.add_argument("--teacher", type=Path, help="the teacher CMF, run live (train.targets: live)")
    ap.add_argument("--grams", type=Path, help="the teacher's input Grams (train.signs.init: margin)")
    ap.add_argument("--teacher-name", default="teacher.cmf", help="the teacher as recorded in the provenance")
    ap.add_argument("--out", required=True, type=Path, help="the trained student CMF (the best held-out snapshot)")
    ap.add_argument("--metrics", required=True, type=Path, help="per-step metrics (JSON lines)")
    ap.add_argument("--settings", required=True, help=SETTINGS_HELP)
    a = ap.parse_args(argv)
    main(a.student, a.windows, a.topk, a.teacher_name, a.out, a.metrics, load(TrainSettings, a.settings), a.teacher, a.grams)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    cli()
