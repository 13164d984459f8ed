"""Faults a long job meets (SPEC §7): real SIGKILLs of the snakemake process group, bad inputs given to
the step modules' command lines, every config value out of range or of the wrong type, and fuzzing of
the CMF reader, the BLR codec and the plan parser. docs/reliability.md lists every case."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from nvg import blr, budget_reencode, import_teacher, teacher_topk, tokenize_windows, train_student
from nvg.cmf import read_cmf
from nvg.config import config_error
from nvg.errors import NvgError
from nvg.plan import parse_plan
from nvg.sources import resolve_path
from tests.conftest import REPO, TOPK_TARGETS, corrupt, fails_cleanly, snakemake, tiny_config

SCHEMA = REPO / "workflow/schemas/config.schema.yaml"


# ---------------------------------------------------------------- kills ----------------------------------------------

def start(workdir: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
           "--configfile", str(workdir / "config.yaml"), *args]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def kill_when(proc: subprocess.Popen, ready, what: str) -> None:
    """SIGKILL the whole process group (snakemake and its running job) as soon as `ready()` holds."""
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not ready():
        time.sleep(0.02)
    assert proc.poll() is None, f"the run finished before it could be killed {what}"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_kills_mid_teacher_shard_and_mid_training_lose_nothing(tiny_hf, tiny_corpus, tmp_path):
    """Kill in the middle of a teacher shard, rerun, kill in the middle of training, rerun: completed shards
    and the latest training state are reused and results/model.cmf is byte-identical to an uninterrupted run."""
    config = tiny_config(tiny_hf, tiny_corpus)
    config["dtgma"]["keep"] = None
    config["teacher_topk"]["shards"] = 4
    config["train"].update(epochs=30, state_every=10, eval_every=40)
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    clean.mkdir()
    killed.mkdir()
    snakemake(clean, config)
    (killed / "config.yaml").write_text(yaml.safe_dump(config))

    shard = lambda i: killed / f"results/teacher/topk.{i}.h5"  # noqa: E731
    shard_log = lambda i: killed / f"logs/teacher_topk.{i}.log"  # noqa: E731

    def mid_shard():  # one shard finished and another one's job running
        done = [i for i in range(4) if shard(i).exists()]
        return bool(done) and any(shard_log(i).exists() and not shard(i).exists() for i in range(4))

    kill_when(start(killed, "--cores", "1"), mid_shard, "in a teacher shard")
    finished = {i: shard(i).stat().st_mtime_ns for i in range(4) if shard(i).exists()}
    assert 0 < len(finished) < 4
    assert not list((killed / "results/teacher").glob("topk.*.h5.tmp*"))
    snakemake(killed, config, "--unlock")

    train_log = killed / "logs/train_student.log"
    kill_when(start(killed, "--cores", "2", "--rerun-incomplete"),
              lambda: train_log.exists() and re.search(r"state saved at step [2-9]0:", train_log.read_text()),
              "in training")
    assert {i: shard(i).stat().st_mtime_ns for i in finished} == finished, "a completed shard was recomputed"
    assert not (killed / "results/model.cmf").exists()
    snakemake(killed, config, "--unlock")
    snakemake(killed, config, "--rerun-incomplete")
    assert re.search(r"resumed .* at step [2-9]0", train_log.read_text())
    assert {i: shard(i).stat().st_mtime_ns for i in finished} == finished
    assert (killed / "results/model.cmf").read_bytes() == (clean / "results/model.cmf").read_bytes()
    assert not list(killed.rglob(".*.tmp*")), "a temporary file was left behind"


# ---------------------------------------------------------------- bad inputs -----------------------------------------

@pytest.mark.parametrize("how, problem", [("truncated", "runs past the end"), ("magic", "magic at offset 0x0")])
def test_corrupt_cmf_teacher(tiny_stages, tiny_cmf, tmp_path, capsys, how, problem):
    bad = corrupt(tiny_cmf, tmp_path / "teacher.cmf", how)
    out = tmp_path / "topk.0.h5"
    fails_cleanly(teacher_topk.cli, ["--teacher", bad, "--windows", tiny_stages / "windows.h5", "--shard", 0,
                                     "--out", out, "--settings", "{}"], capsys, str(bad), problem, [out])


@pytest.mark.parametrize("how", ["truncated", "magic"])
def test_corrupt_hdf5_windows_and_topk(tiny_stages, tmp_path, capsys, how):
    out, metrics = tmp_path / "trained.cmf", tmp_path / "metrics.jsonl"
    bad = corrupt(tiny_stages / "windows.h5", tmp_path / "windows.h5", how)
    args = ["--student", tiny_stages / "student.cmf", "--topk", tiny_stages / "topk.0.h5", "--out", out,
            "--metrics", metrics, "--settings", json.dumps({**TOPK_TARGETS, "state_root": str(tmp_path / "state")})]
    fails_cleanly(train_student.cli, ["--windows", bad, *args], capsys, str(bad), "not a readable windows.h5", [out, metrics])
    bad_topk = corrupt(tiny_stages / "topk.0.h5", tmp_path / "topk.0.h5", how)
    args[3] = bad_topk
    fails_cleanly(train_student.cli, ["--windows", tiny_stages / "windows.h5", *args], capsys, str(bad_topk),
                  "not a readable top-k shard", [out, metrics])


@pytest.mark.parametrize("source, settings, problem", [
    ("EMPTY", {}, "not one 32-token window"),
    ("STORY", {"window": 512}, "exceeds the teacher's max_position_embeddings 256"),
    ("STORY", {"tokens": 16, "eval_windows": 4}, "too few windows"),
])
def test_bad_corpus(tiny_cmf, tiny_corpus, tmp_path, capsys, source, settings, problem):
    path = tmp_path / "empty.txt" if source == "EMPTY" else tiny_corpus / "story.txt"
    path.touch()
    out = tmp_path / "windows.h5"
    settings = {"sources": [{"path": str(path)}], "tokens": 256, "window": 32, **settings}
    fails_cleanly(tokenize_windows.cli, ["--teacher", tiny_cmf, "--out", out, "--settings", json.dumps(settings)],
                  capsys, str(path) if source == "EMPTY" else "window", problem, [out])


@pytest.mark.parametrize("name, content, problem", [
    ("chat.jsonl", '{"messages": [{"role": "user", "content": "hi"}, {"speaker": "bot", "text": "hello"}]}\n',
     "line 1: every message needs a 'role' and a 'content' string"),
    ("pairs.json", '[["a prompt", "a text"], {"prompt": "p", "text": "t"}]',
     "item 1: expected a string or a [prompt, text] list of strings, got dict"),
])
def test_malformed_records_are_refused_not_trained_on_as_text(tiny_cmf, tmp_path, capsys, name, content, problem):
    path = tmp_path / name
    path.write_text(content)
    out = tmp_path / "windows.h5"
    settings = {"sources": [{"path": str(path)}], "tokens": 256, "window": 32}
    fails_cleanly(tokenize_windows.cli, ["--teacher", tiny_cmf, "--out", out, "--settings", json.dumps(settings)],
                  capsys, str(path), problem, [out])


def test_plan_with_errors(tiny_stages, tiny_cmf, tmp_path, capsys):
    plan = tmp_path / "plan.txt"
    plan.write_text("default 1.0\nlayer 0-1 0.5\nlayer 3-2 1.0\n")
    out, report = tmp_path / "encoded.cmf", tmp_path / "encode.json"
    fails_cleanly(budget_reencode.cli, ["--teacher", tiny_cmf, "--grams", tiny_stages / "grams.h5", "--plan", plan,
                                        "--out", out, "--report", report, "--settings", "{}"],
                  capsys, f"{plan}: line 3", "is empty", [out, report])


def schema_leaves(node: dict, path: tuple = ()):
    """(dotted key, its schema) for every settable value of the config schema."""
    for key, sub in node.get("properties", {}).items():
        sub = SCHEMA_DOC["definitions"][sub["$ref"].rsplit("/", 1)[1]] if "$ref" in sub else sub
        if "properties" in sub:
            yield from schema_leaves(sub, (*path, key))
        else:
            yield ".".join((*path, key)), sub


SCHEMA_DOC = yaml.safe_load(SCHEMA.read_text())
DEFAULT_CONFIG = yaml.safe_load((REPO / "config.yaml").read_text())


def bad_values(spec: dict) -> list:
    """A wrong type, and each bound or enum crossed."""
    types = spec.get("type", [])
    types = types if isinstance(types, list) else [types]
    bad = [[1, 2]] if "array" not in types else ["not a list"]
    if "minimum" in spec:
        bad.append(spec["minimum"] - 1)
    if "exclusiveMinimum" in spec:
        bad.append(spec["exclusiveMinimum"])
    if "maximum" in spec:
        bad.append(spec["maximum"] + 1)
    if "exclusiveMaximum" in spec:
        bad.append(spec["exclusiveMaximum"])
    if "enum" in spec:
        bad.append("not-one-of-them")
    return bad


LEAVES = list(schema_leaves(SCHEMA_DOC))


@pytest.mark.parametrize("key, spec", LEAVES, ids=[k for k, _ in LEAVES])
def test_every_config_value_out_of_range_or_of_the_wrong_type(key, spec):
    for value in bad_values(spec):
        config = json.loads(json.dumps(DEFAULT_CONFIG))
        *parents, last = key.split(".")
        node = config
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
        problem = config_error(config, SCHEMA, ["config.yaml"])
        assert problem is not None, (key, value)
        assert problem.startswith(f"{Path('config.yaml').resolve()}: {key}: "), problem
        assert "\n" not in problem
    assert config_error(DEFAULT_CONFIG, SCHEMA, ["config.yaml"]) is None


def overlaid(base: dict, overlay: dict) -> dict:
    """Snakemake's --configfile order: each file's keys update the config so far, nested blocks key by key."""
    out = dict(base)
    for key, value in overlay.items():
        out[key] = overlaid(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@pytest.mark.parametrize("files", [
    *[("bench/gpu_quality.yaml", *([p.relative_to(REPO).as_posix()] if p.name != "gpu_quality.yaml" else []))
      for p in sorted(REPO.glob("bench/gpu_quality*.yaml"))],
    *[("bench/ablation/base.yaml", p.relative_to(REPO).as_posix()) for p in sorted(REPO.glob("bench/ablation/*.yaml"))
      if p.name != "base.yaml"],
], ids=lambda files: files[-1])
def test_every_gpu_recipe_kept_in_bench_is_a_valid_config(files):
    """A recipe with a misspelt key would cost a device session before Snakemake refused it."""
    config = DEFAULT_CONFIG
    for f in files:
        config = overlaid(config, yaml.safe_load((REPO / f).read_text()))
    assert config_error(config, SCHEMA, list(files)) is None


GPU_RECIPE_OVERLAYS = ("live_uv_bsigns_wide", "hidden03", "manuals30", "embedding_lr01", "batch64", "epochs12", "fill",
                      "cuda_graphs", "recompute0", "ends2")


def test_the_gpu_recipe_file_is_the_readmes_overlays_merged():
    """bench/gpu_recipe.yaml, the README's one file for the GPU recipe, holds exactly base.yaml and the measured
    overlays merged in order (less base.yaml's device teacher), so the two cannot drift apart."""
    merged = yaml.safe_load((REPO / "bench/ablation/base.yaml").read_text())
    for name in GPU_RECIPE_OVERLAYS:
        merged = overlaid(merged, yaml.safe_load((REPO / f"bench/ablation/{name}.yaml").read_text()))
    del merged["teacher"]
    recipe = yaml.safe_load((REPO / "bench/gpu_recipe.yaml").read_text())
    assert recipe == merged
    assert config_error(overlaid(DEFAULT_CONFIG, recipe), SCHEMA, ["bench/gpu_recipe.yaml"]) is None
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "--configfile bench/gpu_recipe.yaml" in readme


def test_train_gpus_must_divide_the_batch():
    config = json.loads(json.dumps(DEFAULT_CONFIG))
    config["train"].update(gpus=3, batch=4)
    assert config_error(config, SCHEMA, ["c.yaml"]) == f"{Path('c.yaml').resolve()}: train.gpus: 3 does not divide train.batch 4"


def test_a_text_scored_as_unseen_is_never_calibrated_on():
    """An evaluate.ood text named as a calibration source or as generate_corpus.prompts, or read by one through a
    glob or its folder, is refused by key."""
    names = Path("c.yaml").resolve()
    config = json.loads(json.dumps(DEFAULT_CONFIG))
    config["data"]["sources"] = [{"path": "generated", "weight": 0.7}, {"path": "python-docs", "weight": 0.3}]
    assert config_error(config, SCHEMA, ["c.yaml"]) == (f"{names}: data.sources[1].path: python-docs is also in "
                                                        "evaluate.ood: a text scored as unseen must not be calibrated on")
    config["evaluate"]["ood"] = ["pkg:shksprdata/ancillary/britannica-11th.txt"]
    assert config_error(config, SCHEMA, ["c.yaml"]) is None  # no longer scored, so free to calibrate on
    config["generate_corpus"]["prompts"] = "pkg:shksprdata/ancillary/britannica-11th.txt"
    assert config_error(config, SCHEMA, ["c.yaml"]).startswith(f"{names}: generate_corpus.prompts: pkg:shksprdata")
    config["generate_corpus"]["prompts"] = "pkg:shksprdata/ancillary/*.txt"  # a glob over it
    britannica = resolve_path("pkg:shksprdata/ancillary/britannica-11th.txt").resolve()
    assert config_error(config, SCHEMA, ["c.yaml"]) == (
        f"{names}: generate_corpus.prompts: pkg:shksprdata/ancillary/*.txt reads {britannica}, which evaluate.ood scores "
        "as unseen (pkg:shksprdata/ancillary/britannica-11th.txt): a text scored as unseen must not be calibrated on")
    config["generate_corpus"]["prompts"] = ""
    config["data"]["sources"][1]["path"] = str(britannica.parent)  # the folder it is in
    assert config_error(config, SCHEMA, ["c.yaml"]).startswith(f"{names}: data.sources[1].path: {britannica.parent} reads {britannica}")


def test_bad_config_stops_snakemake_with_one_line(tmp_path):
    config = json.loads(json.dumps(DEFAULT_CONFIG))
    config["train"]["batch"] = "four"
    out = snakemake(tmp_path, config, "-n", check=False)
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {tmp_path / 'config.yaml'}: train.batch: 'four' is not of type 'integer'"], out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "results").exists()


def test_a_failing_stage_shows_its_error_line_in_the_terminal(tiny_hf, tiny_corpus, tmp_path):
    from tests.conftest import tiny_config

    config = tiny_config(tiny_hf, tiny_corpus)
    config["data"]["sources"] = config["data"]["sources"][:1]
    config["teacher_topk"]["k"] = 400
    out = snakemake(tmp_path, config, "results/teacher/topk.0.h5", check=False)
    assert out.returncode != 0
    shown = [line for line in out.stderr.splitlines() if "nvg: error:" in line]
    assert shown and all(line.startswith("logs/teacher_topk.") for line in shown), out.stderr[-3000:]
    assert "config teacher_topk.k: 400 exceeds the teacher's vocabulary of 300" in shown[0]
    assert not list((tmp_path / "results/teacher").glob("topk.*"))


# ------------------------------------------------------- full disk, too little memory -----------------------------

def test_too_little_free_space_is_one_line_before_anything_is_written(tiny_stages, tiny_cmf, tmp_path, capsys, monkeypatch):
    import collections

    from nvg import atomic

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    out = tmp_path / "topk.0.h5"
    fails_cleanly(teacher_topk.cli, ["--teacher", tiny_cmf, "--windows", tiny_stages / "windows.h5", "--shard", 0,
                                     "--out", out, "--settings", '{"k": 8, "shards": 1}'],
                  capsys, str(out), "bytes, only 1,000 are free on its filesystem", [out])


def test_a_full_disk_during_a_write_is_one_line_and_no_output(tiny_hf, tmp_path, capsys, monkeypatch):
    import errno

    def full(self, data):
        open(self, "wb").close()  # the temporary file exists when the disk fills
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_bytes", full)
    out = tmp_path / "teacher.cmf"
    fails_cleanly(import_teacher.cli, ["--source", tiny_hf, "--out", out], capsys, ".teacher.cmf.tmp",
                  "no space left on device", [out])


def test_too_little_memory_is_one_line_naming_the_size(stage_inputs, tmp_path, capsys, monkeypatch):
    from nvg import distill

    def allocation_fails(*args):
        raise MemoryError("Unable to allocate 38.0 GiB for an array with shape (100000, 1024, 64) and data type int32")

    monkeypatch.setattr(distill, "TopkReader", allocation_fails)
    out = tmp_path / "trained.cmf"
    d = stage_inputs
    fails_cleanly(train_student.cli, ["--student", d / "student.cmf", "--windows", d / "windows.h5", "--topk", d / "topk.0.h5",
                                      "--out", out, "--metrics", tmp_path / "m.jsonl", "--settings", json.dumps(TOPK_TARGETS)],
                  capsys, "out of memory", "Unable to allocate 38.0 GiB", [out])


# ---------------------------------------------------------------- lineage ------------------------------------------
# Intermediates changed after they were written, or taken from another run: refused before training,
# in one line naming the file (each of these trained silently before, and the result passed `nvg verify`).


def tampered_copies(tiny_stages, tmp_path, what: str) -> dict:
    """Copies of the stage outputs with one fault; mtimes kept, as a careless copy or an attacker would."""
    import h5py

    from nvg.artifacts import content_hash

    files = {n: tmp_path / n for n in ("windows.h5", "topk.0.h5", "student.cmf")}
    for name, dst in files.items():
        shutil.copy2(tiny_stages / name, dst)
    if what in ("replaced window", "swapped windows", "id out of range"):
        with h5py.File(files["windows.h5"], "r+") as f:
            tokens = f["tokens"][...]
            if what == "replaced window":
                tokens[3] = tokens[4]  # valid ids, another window's
            elif what == "swapped windows":
                tokens[[3, 4]] = tokens[[4, 3]]  # the same 8-byte words in another order: hash64 cannot see it
            else:
                tokens[3, 5] = 100_000
                f.attrs["tokens_blake2b"] = content_hash(tokens)  # a consistent file: only the range check sees it
            f["tokens"][...] = tokens
    elif what in ("other windows", "NaN logp", "ids out of range", "another k"):
        with h5py.File(files["topk.0.h5"], "r+") as f:
            if what == "other windows":
                f.attrs["windows_hash"] = "0" * 32  # a shard made from another data.seed's windows
            elif what == "NaN logp":
                logp = f["logp"][2]
                logp[7, 0] = np.nan
                f["logp"][2] = logp
            elif what == "ids out of range":
                ids = f["ids"][2]
                ids[7, 0] = -4
                f["ids"][2] = ids
        if what == "another k":
            second = tmp_path / "topk.1.h5"
            shutil.copy2(files["topk.0.h5"], second)
            with h5py.File(second, "r+") as f:
                f.attrs["k"] = 4
            files["topk.1.h5"] = second
    elif what == "flipped payload":
        from nvg.cmf import read_cmf

        cmf = read_cmf(files["student.cmf"])
        q = cmf.tensors["model.layers.0.self_attn.q_proj.weight"]
        raw = bytearray(files["student.cmf"].read_bytes())
        at = raw.index(bytes(q.data)) + 32  # 64 bytes inside q_proj's payload
        raw[at : at + 64] = bytes(b ^ 0xFF for b in raw[at : at + 64])
        files["student.cmf"].write_bytes(bytes(raw))
    return files


@pytest.mark.parametrize("what, culprit, problem", [
    ("replaced window", "windows.h5", "do not match their tokens_blake2b"),
    ("swapped windows", "windows.h5", "do not match their tokens_blake2b"),
    ("id out of range", "windows.h5", "token id 100000 is outside the model's vocabulary"),
    ("other windows", "topk.0.h5", "made from other windows"),
    ("NaN logp", "topk.0.h5", "logp holds NaN"),
    ("ids out of range", "topk.0.h5", "ids outside the vocabulary"),
    ("another k", "topk.1.h5", "k 4 differs from"),
    ("flipped payload", "student.cmf", "hash does not match its payload"),
])
def test_a_changed_or_foreign_intermediate_is_refused_before_training(tiny_stages, tmp_path, capsys, what, culprit,
                                                                      problem):
    files = tampered_copies(tiny_stages, tmp_path, what)
    out, metrics = tmp_path / "trained.cmf", tmp_path / "metrics.jsonl"
    topk = [files[n] for n in ("topk.0.h5", "topk.1.h5") if n in files]
    fails_cleanly(train_student.cli, ["--student", files["student.cmf"], "--windows", files["windows.h5"], "--topk", *topk,
                                      "--out", out, "--metrics", metrics,
                                      "--settings", json.dumps({**TOPK_TARGETS, "state_root": str(tmp_path / "state")})],
                  capsys, str(files[culprit]), problem, [out, metrics])


def another_lineage(tiny_stages, tiny_cmf, tmp_path, what: str) -> dict:
    """Copies of the stage outputs and the teacher where one input comes from another run's lineage (its
    recorded hash changed, the file otherwise intact and consistent)."""
    import h5py

    from nvg.cmf import write_cmf

    files = {n: tmp_path / n for n in ("windows.h5", "topk.0.h5", "student.cmf", "grams.h5")}
    for name, dst in files.items():
        shutil.copy2(tiny_stages / name, dst)
    files["teacher.cmf"] = tmp_path / "teacher.cmf"
    shutil.copy2(tiny_cmf, files["teacher.cmf"])
    if what == "top-k of another teacher":
        with h5py.File(files["topk.0.h5"], "r+") as f:
            f.attrs["teacher_hash"] = "0123456789abcdef"
    elif what == "Grams of another model":
        with h5py.File(files["grams.h5"], "r+") as f:
            f.attrs["model_hash"] = "0123456789abcdef"
    elif what in ("student of another teacher", "trained on other windows"):
        cmf = read_cmf(files["student.cmf"])
        prov = dict(cmf.header["provenance"])
        if what == "student of another teacher":
            prov["nvg_encode"] = {**prov["nvg_encode"], "teacher_hash": "0123456789abcdef"}
        else:
            prov["nvg_train"] = {"windows_hash": "0" * 32}
        write_cmf(files["student.cmf"], {**cmf.header, "provenance": prov}, list(cmf.tensors.values()), cmf.vocab)
    return files


@pytest.mark.parametrize("stage, what, culprit, problem", [
    ("train_student", "top-k of another teacher", "topk.0.h5", "top-k of teacher 0123456789abcdef, but"),
    ("budget_reencode", "Grams of another model", "grams.h5", "Grams of model 0123456789abcdef, not of"),
    ("budget_reencode", "student of another teacher", "student.cmf", "encoded from teacher 0123456789abcdef, not from"),
    ("evaluate", "student of another teacher", "student.cmf", "encoded from teacher 0123456789abcdef, not from"),
    ("evaluate", "trained on other windows", "student.cmf", "its held-out rows may be ones it trained on"),
])
def test_an_input_from_another_lineage_is_refused_by_the_stage_that_reads_it(tiny_stages, tiny_cmf, tmp_path, capsys,
                                                                              stage, what, culprit, problem):
    """Each of these files is intact (its own hashes match): only the lineage recorded in it shows that it
    belongs to another run (another teacher, another model's Grams, other windows)."""
    from nvg import evaluate

    f = another_lineage(tiny_stages, tiny_cmf, tmp_path, what)
    out = tmp_path / "out.cmf"
    if stage == "train_student":
        cli, argv = train_student.cli, ["--student", f["student.cmf"], "--windows", f["windows.h5"], "--topk", f["topk.0.h5"],
                                        "--out", out, "--metrics", tmp_path / "m.jsonl",
                                        "--settings", json.dumps({**TOPK_TARGETS, "state_root": str(tmp_path / "state")})]
    elif stage == "budget_reencode":
        student = ["--student", f["student.cmf"]] if what == "student of another teacher" else []
        cli, argv = budget_reencode.cli, ["--teacher", f["teacher.cmf"], "--grams", f["grams.h5"], *student, "--out", out,
                                          "--report", tmp_path / "r.json", "--settings", json.dumps({"bpw": 2.0, "device": "cpu"})]
    else:
        out = tmp_path / "eval.json"
        cli, argv = evaluate.cli, ["--teacher", f["teacher.cmf"], "--encoded", f["student.cmf"], "--final", f["student.cmf"],
                                   "--windows", f["windows.h5"], "--k", "8", "--out", out,
                                   "--settings", json.dumps({"ood": [], "device": "cpu"})]
    fails_cleanly(cli, argv, capsys, str(f[culprit]), problem, [out])


# ---------------------------------------------------------------- fuzzing --------------------------------------------
# Bounded: a fixed number of examples, no deadline (CI machines are slow); derandomized so CI is repeatable.
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def valid_cmf(tmp_path_factory) -> bytes:
    from tests.test_cmf import HEADER, sample_tensors
    from nvg.cmf import cmf_bytes

    return cmf_bytes(HEADER, sample_tensors())


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=8),
       cut=st.one_of(st.none(), st.integers(0, 1 << 20)))
def test_fuzz_cmf_reader(valid_cmf, tmp_path_factory, edits, cut):
    raw = bytearray(valid_cmf)
    for at, byte in edits:
        raw[at % len(raw)] = byte
    if cut is not None:
        raw = raw[: cut % (len(raw) + 1)]
    path = tmp_path_factory.getbasetemp() / "fuzz.cmf"
    path.write_bytes(bytes(raw))
    try:
        cmf = read_cmf(path)
        for t in cmf.tensors.values():  # every payload the reader accepted must decode
            from nvg.cmf import tensor_to_numpy

            tensor_to_numpy(t)
    except NvgError:
        pass


@FUZZ
@given(header=st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(0, 40), st.integers(0, 40)),
       slack=st.sampled_from([0, 0, 0, -1, 1, -16]), seed=st.integers(0, 2**32 - 1))
def test_fuzz_blr_decoder(header, slack, seed):
    """Random headers with payloads of the right size (mostly) and random bytes: scales may be inf/nan."""
    paths, rank, d_out, d_in = header
    size = max(0, paths * blr.path_nbytes(rank, d_out, d_in) + slack)
    raw = blr.HEADER.pack(blr.MAGIC, blr.VERSION, paths, 0, rank, d_out, d_in)
    raw += np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    try:
        tensor = blr.decode(raw)
    except NvgError:
        return
    assert tensor.encode() == raw  # whatever decodes re-encodes to the same bytes
    with np.errstate(all="ignore"):
        assert tensor.dequantize().shape == (d_out, d_in)


PLAN_WORDS = st.sampled_from(["default", "layer", "tensor", "0", "1", "2-5", "5-2", "-1", "0.5", "1e9", "nan", "inf",
                              "x", "model.layers.0.mlp.up_proj.weight", "#", "a-b", "", "32", "0"])


@FUZZ
@given(lines=st.lists(st.one_of(st.lists(PLAN_WORDS, max_size=4).map(" ".join), st.text(max_size=30)), max_size=6))
def test_fuzz_plan_parser(lines):
    try:
        plan = parse_plan("\n".join(lines), "fuzz.plan")
    except NvgError as e:
        assert str(e).startswith("fuzz.plan: line ")
        return
    for _, _, bpw, _ in plan.layers:
        assert 0 < bpw <= 16  # config encode.bpw's bounds (the schema)
    assert np.isfinite([bpw for _, bpw, _ in plan.tensors]).all()


SETTINGS = {"data": "nvg.tokenize_windows.WindowSettings", "generate_corpus": "nvg.generate_corpus.CorpusSettings",
            "teacher_topk": "nvg.teacher_topk.TopkSettings",
            "grams": "nvg.gram_capture.GramSettings", "encode": "nvg.encoder.EncodeSettings",
            "dtgma": "nvg.dtgma_cut.DtgmaSettings", "reconstruct": "nvg.reconstruct_blocks.ReconstructSettings",
            "train": "nvg.train_student.TrainSettings",
            "train.signs": "nvg.sign_training.SignSettings", "reconstruct.signs": "nvg.reconstruct_blocks.BlockSignSettings",
            "evaluate": "nvg.evaluate.EvalSettings"}


@pytest.mark.parametrize("block, cls", SETTINGS.items())
def test_every_setting_is_a_config_key_with_its_default_from_the_schema(block, cls):
    """One source of defaults and bounds, no hidden settings: a step module's settings have exactly the
    keys of their config block, and built from nothing they hold the schema's defaults."""
    import dataclasses
    import importlib

    from nvg.settings import load

    module, name = cls.rsplit(".", 1)
    settings_cls = getattr(importlib.import_module(module), name)
    assert settings_cls.SECTION == block
    node = SCHEMA_DOC
    for part in block.split("."):
        node = node["properties"][part]
        if "$ref" in node:  # a shared definition (`signs`)
            node = SCHEMA_DOC["definitions"][node["$ref"].rsplit("/", 1)[1]]
    names = [f.name for f in dataclasses.fields(settings_cls)]
    assert sorted(names) == sorted(node["properties"]), f"{block}: fields and schema keys differ"
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               for f in dataclasses.fields(settings_cls)), f"{block}: a default outside the schema"
    if block == "dtgma":
        return  # keep defaults to null, which the stage refuses (tested below)
    built = load(settings_cls)
    for key, spec in node["properties"].items():
        spec = SCHEMA_DOC["definitions"][spec["$ref"].rsplit("/", 1)[1]] if "$ref" in spec else spec
        if "properties" not in spec:  # a nested block has its own case
            assert getattr(built, key) == spec["default"], f"{block}.{key}"


def test_the_stage_settings_cover_every_config_block():
    blocks = {k for k, v in SCHEMA_DOC["properties"].items() if v.get("type") == "object"}
    assert blocks == {b for b in SETTINGS if "." not in b}


def test_a_required_setting_left_out_is_named():
    from nvg.dtgma_cut import DtgmaSettings
    from nvg.settings import load

    with pytest.raises(NvgError, match=r"config dtgma\.keep: required"):
        load(DtgmaSettings, "{}")


def test_the_default_config_restates_the_schema_defaults():
    """config.yaml is the default job written out: every value in it is the schema's default, so the
    pipeline with a key left out and the default job agree."""
    from nvg.settings import with_defaults

    defaults = with_defaults(SCHEMA_DOC, {})

    def walk(node, default, path):
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, default.get(key), f"{path}.{key}" if path else key)
        else:
            assert node == default, f"config.yaml {path}: {node!r}, schema default {default!r}"

    walk(DEFAULT_CONFIG, defaults, "")


def test_a_second_writer_of_one_output_is_refused_while_the_first_lives(tmp_path):
    """Without Snakemake's lock two jobs could write one output; the second used to delete the first's
    temporary file (FileNotFoundError at its rename). A dead writer's file is still cleaned up."""
    from nvg.atomic import atomic_path

    out = tmp_path / "x.bin"
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # the first writer, alive
    other = out.with_name(f".{out.name}.tmp{writer.pid}")
    other.write_bytes(b"being written")
    try:
        with pytest.raises(NvgError, match=rf"x.bin: process {writer.pid} is writing it now"):
            with atomic_path(out):
                pass
        assert other.read_bytes() == b"being written" and not out.exists()
    finally:
        writer.kill()
        writer.wait()
    with atomic_path(out) as tmp:  # the writer is dead now: its leftover is removed
        tmp.write_bytes(b"second")
    assert not other.exists() and out.read_bytes() == b"second"
