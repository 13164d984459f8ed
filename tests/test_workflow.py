"""Real Snakemake runs of the whole DAG on a tiny random Llama in a temporary folder (CPU).

One full run (DTG-MA on), then the rerun rules proved from real `snakemake -n` output, and one real
rerun after a setting change."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nvg.cmf import read_cmf, verify
from tests.conftest import REPO

ALL_STAGES = {"tokenize_windows", "teacher_topk", "gram_capture", "budget_reencode", "dtgma_cut",
              "train_student", "export", "evaluate", "report"}


def tiny_config(teacher: Path, corpus: Path) -> dict:
    return {
        "teacher": str(teacher),
        "data": {"sources": [{"path": str(corpus / "story.txt"), "weight": 2.0},
                             {"path": str(corpus / "chat.jsonl"), "weight": 1.0}],
                 "tokens": 3072, "window": 32, "eval_windows": 8, "seed": 7},
        "teacher_topk": {"k": 8, "shards": 2, "batch": 8},
        "grams": {"fit_windows": 16, "sel_windows": 8, "batch": 8},
        "encode": {"bpw": 2.0, "iters": 2},
        "dtgma": {"keep": 0.5, "align": 8, "max_steps": 20, "eval_every": 5, "batch": 8},
        "train": {"epochs": 2, "batch": 8, "lr": 0.005, "eval_every": 4, "state_every": 4},
        "evaluate": {"batch": 8, "ood": str(corpus / "story.txt"), "ood_tokens": 256},
    }


def snakemake(workdir: Path, config: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
           "--configfile", str(workdir / "config.yaml"), "--cores", "2", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def planned_jobs(workdir: Path, config: dict) -> set[str]:
    """The rules a dry run would execute, read from its job-stats table."""
    out = snakemake(workdir, config, "-n", "--quiet", "rules")
    text = out.stdout + out.stderr
    if "Nothing to be done" in text:
        return set()
    jobs = set(re.findall(r"^(\w+)\s+\d+\s*$", text, flags=re.M)) - {"total", "all"}
    assert jobs, text
    return jobs


@pytest.fixture(scope="module")
def finished_run(tiny_hf, tiny_corpus, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    config = tiny_config(tiny_hf, tiny_corpus)
    snakemake(workdir, config)
    return workdir, config


def test_whole_dag_produces_a_verified_model(finished_run):
    import torch

    from nvg.model import load_model

    workdir, _ = finished_run
    model_path = workdir / "results/model.cmf"
    assert verify(model_path) == []
    cmf = read_cmf(model_path)
    prov = cmf.header["provenance"]
    assert prov["dtgma"]["keep"] == 0.5 and all(w % 8 == 0 for w in prov["dtgma"]["widths"])
    assert prov["nvg_train"]["steps"] > 0 and "versions" in prov["nvg_pipeline"]
    masked = read_cmf(workdir / "results/student/masked.cmf")
    assert [(t.name, t.dtype, t.shape, len(t.data)) for t in masked.tensors.values()] == \
           [(t.name, t.dtype, t.shape, len(t.data)) for t in cmf.tensors.values()]
    logits = load_model(cmf)(torch.arange(16).view(1, 16))
    assert torch.isfinite(logits).all()
    report = json.loads((workdir / "results/eval.json").read_text())
    h = report["heldout"]
    assert h["final"]["kl_topk"] < h["encoded"]["kl_topk"]
    assert 0 < report["files"]["encoded"]["body_bpw"] <= 2.0
    encoded = read_cmf(workdir / "results/student/encoded.cmf")
    payload = lambda c: sum(len(t.data) for t in c.tensors.values())  # noqa: E731
    assert payload(cmf) < payload(encoded)  # the cut removed MLP neurons
    assert "ood" in report and report["ood"]["teacher"]["perplexity"] > 1
    for stage in ("train_student", "teacher_topk.0", "budget_reencode"):
        assert (workdir / f"benchmarks/{stage}.tsv").exists()
    assert "held-out KL" in (workdir / "logs/train_student.log").read_text()


def test_report_has_every_plot_and_the_numbers(finished_run):
    workdir, _ = finished_run
    page = (workdir / "results/report.html").read_text()
    report = json.loads((workdir / "results/eval.json").read_text())
    assert page.count('src="data:image/png;base64,') == 4
    for title in ("Perplexity before and after training", "Training", "Bits per weight per layer", "Encoder error per layer"):
        assert f"<h2>{title}</h2>" in page
    assert f"{report['heldout']['final']['perplexity']:.3f}" in page
    assert f"{report['files']['final']['body_bpw']:.4f}" in page


def test_nothing_changed_runs_nothing(finished_run):
    workdir, config = finished_run
    assert planned_jobs(workdir, config) == set()


@pytest.mark.parametrize("change, expected", [
    (("train", "lr", 0.004), {"train_student", "export", "evaluate", "report"}),
    (("teacher_topk", "k", 6), {"teacher_topk", "dtgma_cut", "train_student", "export", "evaluate", "report"}),
    (("encode", "bpw", 1.5), {"budget_reencode", "dtgma_cut", "train_student", "export", "evaluate", "report"}),
    (("evaluate", "batch", 4), {"evaluate", "report"}),
    (("data", "sources", "first-weight"), ALL_STAGES),
])
def test_a_setting_reruns_exactly_what_it_invalidates(finished_run, change, expected):
    workdir, config = finished_run
    changed = copy.deepcopy(config)
    block, key, value = change
    if value == "first-weight":
        changed["data"]["sources"][0]["weight"] = 3.0
    else:
        changed[block][key] = value
    assert planned_jobs(workdir, changed) == expected


def test_a_real_rerun_after_changing_the_learning_rate(finished_run):
    workdir, config = finished_run
    changed = copy.deepcopy(config)
    changed["train"]["lr"] = 0.003
    before = (workdir / "results/student/encoded.cmf").stat().st_mtime_ns
    out = snakemake(workdir, changed)
    ran = set(re.findall(r"rule (\w+):", out.stdout + out.stderr)) - {"all"}
    assert ran == {"train_student", "export", "evaluate", "report"}
    assert (workdir / "results/student/encoded.cmf").stat().st_mtime_ns == before
    prov = read_cmf(workdir / "results/model.cmf").header["provenance"]
    assert prov["nvg_train"]["lr"] == 0.003
    assert planned_jobs(workdir, changed) == set()


def test_lint_is_clean():
    out = subprocess.run([sys.executable, "-m", "snakemake", "--lint", "--snakefile", str(REPO / "Snakefile"),
                          "--directory", str(REPO)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
