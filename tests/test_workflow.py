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

from nvg.cli import STAGES
from nvg.cmf import read_cmf, verify
from tests.conftest import REPO, planned_jobs, snakemake, tiny_config

AFTER_DATA = {"tokenize_windows", "teacher_topk", "gram_capture", "budget_reencode", "dtgma_cut",
              "reconstruct_blocks", "train_student", "export", "evaluate", "report"}


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
    assert prov["nvg_reconstruct"]["tokens_per_block"] == 3 * 4 * 32 and len(prov["nvg_reconstruct"]["blocks"]) == 2
    masked = read_cmf(workdir / "results/student/masked.cmf")
    assert [(t.name, t.dtype, t.shape, len(t.data)) for t in masked.tensors.values()] == \
           [(t.name, t.dtype, t.shape, len(t.data)) for t in cmf.tensors.values()]
    logits = load_model(cmf)(torch.arange(16).view(1, 16))
    assert torch.isfinite(logits).all()
    report = json.loads((workdir / "results/eval.json").read_text())
    h = report["heldout"]
    # the encoder's student (here cut) and the one training started from (reconstructed), each scored
    assert report["files"]["encoded"]["path"].endswith("student/masked.cmf") and report["files"]["encoded"]["body_bpw"] > 0
    assert report["files"]["reconstructed"]["path"].endswith("student/reconstructed.cmf")
    assert h["final"]["kl_topk"] < h["reconstructed"]["kl_topk"] and h["reconstructed"]["kl_topk"] != h["encoded"]["kl_topk"]
    encoded = read_cmf(workdir / "results/student/encoded.cmf")
    payload = lambda c: sum(len(t.data) for t in c.tensors.values())  # noqa: E731
    assert payload(cmf) < payload(encoded)  # the cut removed MLP neurons
    assert len(report["ood"]) == 1 and next(iter(report["ood"].values()))["teacher"]["perplexity"] > 1
    for stage in ("train_student", "teacher_topk.0", "budget_reencode"):
        assert (workdir / f"benchmarks/{stage}.tsv").exists()
    assert "held-out KL" in (workdir / "logs/train_student.log").read_text()
    # every torch stage says what it computes in (a CPU set to bf16 computes in float32 where bf16 is slower)
    for log, key in (("gram_capture.teacher", "grams"), ("teacher_topk.0", "teacher_topk"),
                     ("reconstruct_blocks", "reconstruct"), ("train_student", "train"), ("evaluate", "evaluate")):
        line = rf"computing in (fp32|bf16) on cpu \({key}\.precision (fp32|bf16)\)"
        assert re.search(line, (workdir / f"logs/{log}.log").read_text()), log


def test_the_report_times_only_the_stages_that_made_the_model(finished_run):
    """eval.json's stage times come from the files of this config's chain (common.smk `chain_benchmarks`), not
    every file under benchmarks/: a setting that drops a stage leaves that stage's old file out."""
    workdir, config = finished_run
    report = json.loads((workdir / "results/eval.json").read_text())
    assert set(report["stage_seconds"]) == {
        "import_teacher", "generate_corpus.0", "generate_corpus.1", "tokenize_windows", "gram_capture.teacher",
        "budget_reencode", "teacher_topk.0", "teacher_topk.1", "dtgma_cut", "reconstruct_blocks", "train_student"}
    changed = copy.deepcopy(config)
    changed["train"]["targets"], changed["dtgma"]["keep"], changed["reconstruct"]["steps"] = "live", None, 0
    dry = snakemake(workdir, changed, "-n", "-p", "results/eval.json")
    command = re.search(r"python -m nvg\.evaluate .*", dry.stdout + dry.stderr).group(0)
    assert "benchmarks/train_student.tsv" in command and "benchmarks/budget_reencode.tsv" in command
    assert (workdir / "benchmarks/reconstruct_blocks.tsv").exists()  # the earlier run's, still there
    assert not re.search(r"teacher_topk|reconstruct_blocks|dtgma_cut", command.split("--benchmarks")[1])


def test_a_run_against_the_live_teacher_plans_no_top_k(tiny_hf, tiny_corpus, tmp_path):
    """Only training on cached targets (and the DTG-MA cut) reads the top-k: evaluate takes its own."""
    config = tiny_config(tiny_hf, tiny_corpus)
    config["train"]["targets"], config["dtgma"]["keep"] = "live", None
    jobs = planned_jobs(tmp_path, config)
    assert "teacher_topk" not in jobs and {"train_student", "evaluate"} <= jobs


def test_nothing_changed_runs_nothing(finished_run):
    workdir, config = finished_run
    assert planned_jobs(workdir, config) == set()


@pytest.mark.parametrize("change, expected", [
    (("train", "lr", 0.004), {"train_student", "export", "evaluate", "report"}),
    (("train", "targets", "live"), {"train_student", "export", "evaluate", "report"}),
    (("teacher_topk", "k", 6), {"teacher_topk", "dtgma_cut", "reconstruct_blocks", "train_student", "export", "evaluate", "report"}),
    (("encode", "bpw", 1.5), {"budget_reencode", "dtgma_cut", "reconstruct_blocks", "train_student", "export", "evaluate", "report"}),
    (("reconstruct", "lr", 0.03), {"reconstruct_blocks", "train_student", "export", "evaluate", "report"}),
    (("reconstruct", "steps", 0), {"train_student", "export", "evaluate", "report"}),  # trains the cut student
    (("evaluate", "batch", 4), {"evaluate", "report"}),
    (("data", "sources", "first-weight"), AFTER_DATA),
    (("generate_corpus", "temperature", 0.7), {"generate_corpus"} | AFTER_DATA),
    (("generate_corpus", "prompt_tokens", 8), set()),  # unread while no prompts open the sequences
    (("generate_corpus", "prompts", "the-first-source"), {"generate_corpus"} | AFTER_DATA),
    (("encode", "embedding_bpw", 2.0), set()),  # an f16 embedding reads none of the blr / GPTQ settings
    (("encode", "embedding_damp", 0.5), set()),
])
def test_a_setting_reruns_exactly_what_it_invalidates(finished_run, change, expected):
    workdir, config = finished_run
    changed = copy.deepcopy(config)
    block, key, value = change
    if value == "first-weight":
        changed["data"]["sources"][0]["weight"] = 3.0
    elif value == "the-first-source":
        changed[block][key] = config["data"]["sources"][0]["path"]
    else:
        changed[block][key] = value
    assert planned_jobs(workdir, changed) == expected


def nvg_imports(module: str) -> set[str]:
    """The nvg modules `nvg/<module>.py` imports directly, read from its code."""
    import ast

    found = set()
    for node in ast.walk(ast.parse((REPO / "nvg" / f"{module}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nvg"):
            found |= {node.module.split(".", 1)[1]} if "." in node.module else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".", 1)[1] for a in node.names if a.name.startswith("nvg.")}
    return {m for m in found if (REPO / "nvg" / f"{m}.py").exists()}


def runs_code_of(stage: str) -> set[str]:
    """Every nvg module the stage's step module imports, transitively, and the package's __init__."""
    seen, todo = {"__init__"}, [stage]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(nvg_imports(m))
    return seen


def test_no_stage_imports_another_stage_and_every_stage_has_its_rule_and_test():
    modules = sorted(p.stem for p in (REPO / "nvg").glob("*.py"))
    for module in modules:
        if module == "cli":
            continue  # the command line runs stages by name (importlib), like Snakemake does
        others = nvg_imports(module) & (set(STAGES) - {module})
        assert not others, f"nvg/{module}.py imports stage module(s) {sorted(others)}"
    rules = {p.stem for p in (REPO / "workflow/rules").glob("*.smk")} - {"common"}
    assert rules == set(STAGES)
    for stage in STAGES:
        assert (REPO / "tests" / f"test_{stage}.py").exists(), f"tests/test_{stage}.py is missing"


def downstream(workdir: Path, config: dict) -> dict[str, set[str]]:
    """Every rule's consumers, transitively, from the real `snakemake --rulegraph`."""
    dot = snakemake(workdir, config, "--rulegraph").stdout
    names = dict(re.findall(r"^\s*(\d+)\[label = \"(\w+)\"", dot, flags=re.M))
    after: dict[str, set[str]] = {n: set() for n in names.values()}
    for a, b in re.findall(r"^\s*(\d+) -> (\d+)", dot, flags=re.M):
        after[names[a]].add(names[b])
    closure = {}
    for rule in after:
        seen, todo = set(), list(after[rule])
        while todo:
            r = todo.pop()
            if r not in seen:
                seen.add(r)
                todo.extend(after[r])
        closure[rule] = seen - {"all"}
    return closure


def test_editing_a_module_reruns_exactly_the_stages_that_run_it(finished_run):
    """For every nvg/*.py: the dry run after editing it plans exactly the stages whose step module
    imports it (transitively, computed from the code) and the stages after them in the DAG."""
    import os

    workdir, config = finished_run
    after = downstream(workdir, config)
    stages = set(after) - {"all"}
    checked = 0
    for path in sorted((REPO / "nvg").glob("*.py")):
        direct = {s for s in stages if path.stem in runs_code_of(s)}
        expected = set().union(direct, *(after[s] for s in direct))
        code, st = path.read_bytes(), path.stat()
        path.write_bytes(code + b"\n# an edit\n")  # Snakemake compares checksums: a bare touch is no change
        try:
            assert planned_jobs(workdir, config) == expected, path.name
        finally:
            path.write_bytes(code)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        checked += bool(expected)
    assert checked >= 20
    assert planned_jobs(workdir, config) == set()


@pytest.mark.parametrize("text, expected", [
    ("story.txt", AFTER_DATA),  # calibrated on (data.sources)
    ("essay.txt", {"evaluate", "report"}),  # scored as unseen (evaluate.ood)
])
def test_editing_a_text_reruns_exactly_the_stages_that_read_it(finished_run, tiny_corpus, text, expected):
    """A text's path is in the params, its content is not: its files are the reading stage's inputs, so an edit
    under the same path reruns that stage and what follows, as a changed setting does."""
    import os

    workdir, config = finished_run
    path = tiny_corpus / text
    raw, st = path.read_bytes(), path.stat()
    path.write_bytes(raw + b"One more sentence of the same text.\n")
    try:
        assert planned_jobs(workdir, config) == expected
    finally:
        path.write_bytes(raw)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert planned_jobs(workdir, config) == set()


@pytest.mark.parametrize("key", ["data.sources", "generate_corpus.prompts", "evaluate.ood"])
def test_a_text_source_that_finds_nothing_is_one_line_before_any_job(finished_run, tmp_path, key):
    workdir, config = finished_run
    changed = copy.deepcopy(config)
    missing = str(tmp_path / "nowhere" / "*.txt")
    block, name = key.split(".")
    if name == "sources":
        changed["data"]["sources"].append({"path": missing, "weight": 1.0})
    elif name == "prompts":
        changed[block][name] = missing
    else:
        changed[block][name] = [missing]
    out = snakemake(workdir, changed, "-n", check=False)
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: config {key}: {missing}: no .txt/.md/.rst/.info/.jsonl/.json files (or .gz of them) in this source"], out.stderr


def test_a_real_rerun_with_a_live_teacher_and_another_learning_rate(finished_run):
    workdir, config = finished_run
    changed = copy.deepcopy(config)
    changed["train"].update(lr=0.003, targets="live", hidden_weight=0.5)
    before = (workdir / "results/student/encoded.cmf").stat().st_mtime_ns
    out = snakemake(workdir, changed)
    ran = set(re.findall(r"rule (\w+):", out.stdout + out.stderr)) - {"all"}
    assert ran == {"train_student", "export", "evaluate", "report"}
    assert (workdir / "results/student/encoded.cmf").stat().st_mtime_ns == before
    prov = read_cmf(workdir / "results/model.cmf").header["provenance"]
    assert prov["nvg_train"]["lr"] == 0.003 and prov["nvg_train"]["targets"] == "live"
    assert planned_jobs(workdir, changed) == set()


def test_hidden_weight_is_not_read_under_the_cached_topk(finished_run):
    """The cached top-k has no hidden states and no live teacher: its runs keep the schema's hidden_weight (0.3),
    hidden_decay, hidden_epochs and teacher_memo_gb, and changing any of them there reruns nothing (train_student's
    params leave them out)."""
    workdir, config = finished_run
    assert config["train"]["targets"] == "topk" and "hidden_weight" not in config["train"]
    snakemake(workdir, config)  # the top-k run's outputs, whatever an earlier test left
    changed = copy.deepcopy(config)
    changed["train"].update(hidden_weight=0.9, hidden_decay=True, hidden_epochs=1, teacher_memo_gb=8)
    assert planned_jobs(workdir, changed) == set()
    changed["train"]["lr"] = 0.004
    assert "train_student" in planned_jobs(workdir, changed)


def test_lint_is_clean():
    out = subprocess.run([sys.executable, "-m", "snakemake", "--lint", "--snakefile", str(REPO / "Snakefile"),
                          "--directory", str(REPO)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_moved_checkout_keeps_its_cache(tiny_hf, tiny_corpus, tmp_path):
    """The step modules' sources are declared relative to the working directory: a checkout copied
    elsewhere (mtimes kept) plans nothing for what it already made."""
    import shutil

    first = tmp_path / "first"
    first.mkdir()
    for part in ("Snakefile", "workflow", "nvg"):
        if (REPO / part).is_dir():
            shutil.copytree(REPO / part, first / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / part, first / part)
    (first / "config.yaml").write_text(yaml.safe_dump(tiny_config(tiny_hf, tiny_corpus)))

    def run(checkout: Path, *args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "snakemake", "--snakefile", str(checkout / "Snakefile"),
                               "--directory", str(checkout), "--cores", "1", *args, "results/teacher.cmf"],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout + proc.stderr

    run(first)
    moved = tmp_path / "elsewhere" / "deeper" / "checkout"
    shutil.copytree(first, moved, symlinks=True)
    assert "Nothing to be done" in run(moved, "-n")
