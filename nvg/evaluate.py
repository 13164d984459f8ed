"""Stage `evaluate`: teacher, encoded student, reconstructed student (when reconstruct_blocks runs) and
final student, side by side → `eval.json`.

On the held-out windows (all of them, and those of each calibration source apart when there are several:
a real source mixed in makes the held-out windows a mix too) and on every out-of-domain source in `ood`:
perplexity and its ratio to the teacher's, KL to the teacher over the full vocabulary and over its top-k
(what top-k distillation matches; the teacher's top-k taken here, so that a run training against the live
teacher needs no teacher_topk stage), the teacher's probability mass outside that top-k, top-1 agreement
with the teacher; bits per weight of the body linears and of the whole file counted from the stored bytes; file sizes;
wall time per stage from the rules' benchmark files.

    python -m nvg.evaluate --teacher T.cmf --encoded E.cmf [--reconstructed R.cmf] --final M.cmf --windows W.h5 \
        --k 64 --out eval.json --settings JSON [--benchmarks benchmarks/STAGE.tsv ...]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from nvg.artifacts import check_encoded_from, read_window_origins, read_windows
from nvg.atomic import write_json
from nvg.cmf import read_verified
from nvg.errors import NvgError, exits_cleanly
from nvg.layout import bits_summary
from nvg.losses import next_token_nll, student_scores, topk_kl, topk_logprobs
from nvg.model import autocast, computing_in, load_model, pick_device
from nvg.progress import bar
from nvg.settings import SETTINGS_HELP, load
from nvg.sources import ChatRenderer, source_tokens
from nvg.tokenizer import cmf_tokenizer


@dataclass
class EvalSettings:
    """Config block `evaluate` (defaults and bounds: the schema; build with `nvg.settings.load`)."""

    SECTION: ClassVar[str] = "evaluate"
    batch: int
    ood: list
    ood_tokens: int
    device: str
    precision: str


@dataclass
class ScoredSet:
    """One text to score: its windows, and what the teacher pass leaves for the students: per batch its
    final hidden states and its top-k (ids and log-probs), and its sums."""

    label: str
    windows: np.ndarray
    t_hidden: list = field(default_factory=list)
    t_topk: list = field(default_factory=list)
    sums: dict = field(default_factory=dict)  # model → {nll, kl_full, kl_topk, agree}
    tail: float = 0.0

    def batches(self, batch: int):
        return bar(math.ceil(len(self.windows) / batch), f"evaluate {self.label}", "batch", range(0, len(self.windows), batch))


@torch.no_grad()
def teacher_pass(teacher, sets: list[ScoredSet], settings: EvalSettings, device, k: int) -> None:
    """The teacher on every set: its own scores, its probability mass outside its top-k (what top-k
    distillation never shows the student), and its final hidden states and top-k, kept for the students
    (a fraction of the model's size) so that the teacher can leave memory before any student is loaded."""
    for st in sets:
        acc = st.sums["teacher"] = {"nll": 0.0, "kl_full": 0.0, "kl_topk": 0.0, "agree": 0}
        for s in st.batches(settings.batch):
            ids = torch.from_numpy(st.windows[s : s + settings.batch]).to(device)
            with autocast(device, settings.precision):
                h = teacher.hidden(ids)
                acc["nll"] += float(next_token_nll(h[:, :-1], teacher.logits_head(), ids[:, 1:]))
                acc["agree"] += ids.numel()  # against itself: KL 0 and full agreement by definition
                top = topk_logprobs(h, teacher.logits_head(), k)
                acc["kl_topk"] += float(topk_kl(h, teacher.logits_head(), *top))
                st.tail += float((1 - top[1].exp().sum(-1)).clamp_min(0).sum())
            st.t_hidden.append(h)
            st.t_topk.append(top)


@torch.no_grad()
def student_pass(name: str, student, t_head, sets: list[ScoredSet], settings: EvalSettings, device) -> None:
    """A student on every set against the teacher's cached hidden states: nll, full KL, top-k KL, agreement."""
    for st in sets:
        acc = st.sums[name] = {"nll": 0.0, "kl_full": 0.0, "kl_topk": 0.0, "agree": 0}
        for j, s in enumerate(st.batches(settings.batch)):
            ids = torch.from_numpy(st.windows[s : s + settings.batch]).to(device)
            with autocast(device, settings.precision):
                h = student.hidden(ids)
                nll, kl, agree = student_scores(st.t_hidden[j], h, t_head, student.logits_head(), ids)
                acc["nll"] += float(nll)
                acc["kl_full"] += float(kl)
                acc["agree"] += agree
                acc["kl_topk"] += float(topk_kl(h, student.logits_head(), *st.t_topk[j]))


def summary(st: ScoredSet, k: int) -> dict:
    """Per model: perplexity and its ratio to the teacher's, full KL, top-k KL, top-1 agreement."""
    n_tok, n_pred = st.windows.size, st.windows[:, 1:].size
    out = {}
    for name, a in st.sums.items():
        out[name] = {"perplexity": math.exp(a["nll"] / n_pred), "kl_full": a["kl_full"] / n_tok,
                     "kl_topk": a["kl_topk"] / n_tok, "top1_agreement": a["agree"] / n_tok}
    for name in st.sums:  # how far from the teacher, the number a user reads first
        out[name]["ppl_ratio"] = out[name]["perplexity"] / out["teacher"]["perplexity"]
    out["tokens"] = n_tok
    out["teacher_mass_outside_topk"] = {"k": k, "mean": st.tail / n_tok}
    return out


def pooled(label: str, parts: list[ScoredSet]) -> ScoredSet:
    """The sets scored apart as one: their windows and their sums (every score is a sum over tokens)."""
    whole = ScoredSet(label, np.concatenate([p.windows for p in parts]), tail=sum(p.tail for p in parts))
    whole.sums = {m: {key: sum(p.sums[m][key] for p in parts) for key in parts[0].sums[m]} for m in parts[0].sums}
    return whole


def stage_seconds(paths: list[Path]) -> dict:
    """Wall time of each stage from Snakemake's benchmark TSVs (`s` column): the workflow names the files of the
    stages that made this model (common.smk `chain_benchmarks`); one that does not exist (the stage's outputs came
    from elsewhere) is left out."""
    out = {}
    for p in paths:
        if not p.is_file():
            continue
        with open(p) as f:
            rows = list(csv.DictReader(f, delimiter="\t"))
        if rows:
            out[p.stem] = float(rows[-1]["s"])
    return out


def main(teacher: Path, encoded: Path, final: Path, windows: Path, k: int, out: Path,
         settings: EvalSettings, benchmarks: list[Path], reconstructed: Path | None = None) -> None:
    students = {"encoded": encoded, **({"reconstructed": reconstructed} if reconstructed else {}), "final": final}
    cmfs = {"teacher": read_verified(teacher), **{name: read_verified(path) for name, path in students.items()}}
    vocab = cmfs["teacher"].arch["vocab_size"]
    tokens, attrs = read_windows(windows, vocab)
    if not 0 < k <= vocab:
        raise NvgError(f"--k {k}: the top-k must be between 1 and the teacher's vocabulary size {vocab}")
    n_train = int(attrs["n_train"])
    for name in students:
        check_encoded_from(cmfs[name], cmfs["teacher"])
    trained_on = cmfs["final"].header.get("provenance", {}).get("nvg_train", {}).get("windows_hash")
    if trained_on is not None and trained_on != attrs["tokens_blake2b"]:
        raise NvgError(f"{final}: trained on windows {trained_on}, not on {windows}'s ({attrs['tokens_blake2b']}): "
                       "its held-out rows may be ones it trained on")
    device = pick_device(settings.device)
    print(f"evaluate: {computing_in(device, 'evaluate.precision', settings.precision)}", file=sys.stderr)
    sources = [src["path"] for src in json.loads(attrs["sources"])]
    origin = read_window_origins(windows, len(tokens), len(sources))[n_train:]
    held_out = {src: ScoredSet(f"held-out {src}", tokens[n_train:][origin == i]) for i, src in enumerate(sources)
                if (origin == i).any()}
    sets = list(held_out.values())
    if settings.ood:
        tok = cmf_tokenizer(cmfs["teacher"], teacher, "tokenize evaluate.ood with")
        window = tokens.shape[1]
        for source in settings.ood:
            ids = source_tokens(source, settings.ood_tokens, tok, ChatRenderer(cmfs["teacher"], source))
            ood = ids[: len(ids) // window * window].reshape(-1, window)
            if len(ood) == 0:
                raise NvgError(f"{source}: fewer than one {window}-token window of out-of-domain text")
            sets.append(ScoredSet(source, ood))
    # One model in memory at a time: the teacher, then each student against its cached hidden states. Every model
    # runs eager, on CUDA too: each passes over the sets once (about 100k tokens in the GPU recipe), where compiling
    # the blocks of four models, one compile per block signature (several in a student under ends_factor and
    # paths auto), cost more than the passes save (evaluate took 43 s in session 60's run).
    teacher = load_model(cmfs["teacher"], device)
    teacher_pass(teacher, sets, settings, device, k)
    with autocast(device, settings.precision):
        t_head = teacher.logits_head()  # the students' passes take it in their compute dtype
    del teacher
    for name in students:
        student = load_model(cmfs[name], device)
        student_pass(name, student, t_head, sets, settings, device)
        del student
    report = {"heldout": summary(pooled("held-out", list(held_out.values())), k)}
    if len(sources) > 1:
        report["heldout_by_source"] = {src: summary(st, k) for src, st in held_out.items()}
    if settings.ood:
        report["ood"] = {st.label: summary(st, k) for st in sets[len(held_out):]}
    report["files"] = {n: {"path": str(c.path), "bytes": c.path.stat().st_size, **bits_summary(c)} for n, c in cmfs.items()}
    report["training_tokens"] = cmfs["final"].header.get("provenance", {}).get("nvg_train", {}).get("tokens")
    report["stage_seconds"] = stage_seconds(benchmarks)
    write_json(out, report)
    h = report["heldout"]
    print(f"evaluate: held-out ppl teacher {h['teacher']['perplexity']:.2f}, encoded {h['encoded']['perplexity']:.2f}, "
          + (f"reconstructed {h['reconstructed']['perplexity']:.2f}, " if reconstructed else "") + f"final {h['final']['perplexity']:.2f} ({h['final']['ppl_ratio']:.2f}× the teacher); KL(top-k) encoded "
          f"{h['encoded']['kl_topk']:.4f} → final {h['final']['kl_topk']:.4f}; body bpw {report['files']['final']['body_bpw']:.4f}",
          file=sys.stderr)
    for source, r in report.get("heldout_by_source", {}).items():
        print(f"evaluate: held out from {source}: ppl teacher {r['teacher']['perplexity']:.2f}, final "
              f"{r['final']['perplexity']:.2f} ({r['final']['ppl_ratio']:.2f}× the teacher)", file=sys.stderr)
    for source, r in report.get("ood", {}).items():
        print(f"evaluate: out of domain {source}: ppl teacher {r['teacher']['perplexity']:.2f}, final "
              f"{r['final']['perplexity']:.2f} ({r['final']['ppl_ratio']:.2f}× the teacher)", file=sys.stderr)
    print(f"evaluate: → {out}", file=sys.stderr)


@exits_cleanly
def cli(argv=None):
    ap = argparse.ArgumentParser(prog="nvg evaluate", description=__doc__.splitlines()[0])
    for name, what in (("teacher", "the teacher CMF"), ("encoded", "the encoder's student (cut when dtgma_cut runs)"), ("final", "the trained student"),
                       ("windows", "the token windows (their held-out rows are scored)"), ("out", "eval.json")):
        ap.add_argument(f"--{name}", required=True, type=Path, help=what)
    ap.add_argument("--reconstructed", type=Path, help="the block-wise reconstructed student, when reconstruct_blocks runs")
    ap.add_argument("--k", required=True, type=int, help="the top-k of the top-k KL and of the teacher's mass outside it (config teacher_topk.k)")
    ap.add_argument("--benchmarks", type=Path, nargs="*", default=[], help="Snakemake benchmark TSVs: their wall times go into eval.json")
    ap.add_argument("--settings", required=True, help=SETTINGS_HELP)
    a = ap.parse_args(argv)
    main(a.teacher, a.encoded, a.final, a.windows, a.k, a.out, load(EvalSettings, a.settings), a.benchmarks, a.reconstructed)


if __name__ == "__main__":
    cli()
