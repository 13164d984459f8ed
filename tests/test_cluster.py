"""The whole DAG through a real executor plugin (cluster-generic) with a local stand-in for sbatch
(tests/profiles/cluster-generic): jobscripts, resources, the profile, and resumption after a time limit."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import yaml

from nvg.cmf import verify
from tests.conftest import REPO, tiny_config

PROFILE = REPO / "tests/profiles/cluster-generic"
GPU_RULES = {"generate_corpus", "teacher_topk", "gram_capture", "budget_reencode", "train_student", "evaluate"}


def test_whole_dag_through_an_executor_plugin_resumes_after_a_time_limit(tiny_hf, tiny_corpus, tmp_path):
    config = tiny_config(tiny_hf, tiny_corpus)
    config["dtgma"]["keep"] = None
    config["reconstruct"]["steps"] = 0
    config["train"].update(epochs=30, state_every=10, eval_every=40)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path),
         "--configfile", str(tmp_path / "config.yaml"), "--workflow-profile", str(PROFILE)],
        capture_output=True, text=True, timeout=1200, env={**os.environ, "NVG_CLUSTER_PROFILE": str(PROFILE)})
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert verify(tmp_path / "results/model.cmf") == []

    submitted = [line.split() for line in (tmp_path / "cluster/submitted.txt").read_text().splitlines()]
    requests = {}
    for rule, *resources in submitted:
        requests.setdefault(rule, []).append(dict(r.split("=") for r in resources))
    assert set(requests) == {"import_teacher", "generate_corpus", "tokenize_windows", "teacher_topk", "gram_capture", "budget_reencode",
                             "train_student", "export", "evaluate", "report"}
    assert len(requests["teacher_topk"]) == config["teacher_topk"]["shards"]  # one job per shard
    assert len(requests["generate_corpus"]) == config["generate_corpus"]["shards"]
    for rule, jobs in requests.items():
        assert all(j["gpu"] == ("1" if rule in GPU_RULES else "0") for j in jobs), (rule, jobs)
    # the first training job was stopped at its "time limit"; the retry asked for twice the runtime and resumed
    assert [j["runtime"] for j in requests["train_student"]] == ["240", "480"]
    assert [j["mem_mb"] for j in requests["train_student"]] == ["32000", "32000"]
    # SIGTERM came after the state of step 10 was saved: train_student saved it again at the step it stopped
    resumed = re.search(r"resumed .* at step (\d+) ", (tmp_path / "logs/train_student.log").read_text())
    assert resumed and int(resumed.group(1)) >= 10
