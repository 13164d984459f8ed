"""Progress: every stage's bar reaches its log as whole lines with a rate and an ETA, and `nvg progress`
tells a workflow's state from its logs and benchmark files."""

from __future__ import annotations

import os
import time

from nvg.cli import STAGES, main as nvg
from nvg.progress import stage_states
from nvg.settings import load
from nvg.teacher_topk import TopkSettings, main as teacher_topk


def test_a_stage_writing_to_a_file_gives_one_progress_line_per_update(tiny_cmf, tiny_stages, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("nvg.progress.FILE_INTERVAL", 0.0)  # every update a line
    teacher_topk(tiny_cmf, tiny_stages / "windows.h5", 0, tmp_path / "topk.0.h5", load(TopkSettings, k=8, shards=1, batch=8))
    err = capsys.readouterr().err
    assert "\r" not in err
    bars = [line for line in err.splitlines() if line.startswith("teacher_topk shard 0:")]
    assert len(bars) >= 7, err  # 56 windows, 8 a batch
    assert bars[-1].startswith("teacher_topk shard 0: 100%") and "56/56" in bars[-1] and "window/s" in bars[-1]
    assert "<" in bars[1]  # elapsed<remaining: the ETA


def test_nvg_progress_reports_each_jobs_status_time_and_latest_line(tmp_path, capsys):
    logs, bench = tmp_path / "logs", tmp_path / "benchmarks"
    logs.mkdir()
    bench.mkdir()
    (logs / "import_teacher.log").write_text("import_teacher: 272 tensors → results/teacher.cmf\n")
    (bench / "import_teacher.tsv").write_text("s\th:m:s\n30.8\t0:00:30\n")
    (logs / "teacher_topk.0.log").write_text("teacher_topk shard 0:  40%|####      | 29/72 [00:09<00:14, 3.1window/s]\n")
    (logs / "teacher_topk.1.log").write_text("teacher_topk shard 1:  10%|#         | 7/72 [00:02<00:20, 3.1window/s]\n")
    old = time.time() - 3600
    os.utime(logs / "teacher_topk.1.log", (old, old))  # nothing written for an hour: the job is gone
    (logs / "gram_capture.teacher.log").write_text("nvg: error: results/data/windows.h5: do not match their tokens_blake2b\n")
    rows = {r["job"]: r for r in stage_states(tmp_path, STAGES)}
    assert rows["import_teacher"]["status"] == "done" and rows["import_teacher"]["seconds"] == 30.8
    assert rows["teacher_topk.0"]["status"] == "running" and "29/72" in rows["teacher_topk.0"]["last"]
    assert rows["teacher_topk.1"]["status"] == "stopped"
    assert rows["gram_capture.teacher"]["status"] == "failed"
    assert rows["train_student"]["status"] == "pending"
    nvg(["progress", str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[:-1]] == [r["job"] for r in stage_states(tmp_path, STAGES)]
    assert "29/72 [00:09<00:14" in next(line for line in out if line.startswith("teacher_topk.0"))
    assert out[-1].startswith("1 of ") and "30.8 s in finished jobs" in out[-1]


def test_every_option_of_every_command_has_help(monkeypatch, capsys):
    """`--help` of `nvg` and of every stage and tool explains each option, not only names it."""
    import argparse
    import importlib

    import pytest

    from nvg.cli import TOOLS

    calls = []
    add_argument = argparse.ArgumentParser.add_argument

    def record(self, *names, **kw):
        calls.append((self.prog, names, kw))
        return add_argument(self, *names, **kw)

    monkeypatch.setattr(argparse.ArgumentParser, "add_argument", record)
    for module in STAGES + TOOLS:
        with pytest.raises(SystemExit):
            importlib.import_module(f"nvg.{module}").cli(["--help"])
    with pytest.raises(SystemExit):
        nvg(["--help"])
    missing = [(prog, names) for prog, names, kw in calls
               if names not in (("-h", "--help"), ("--version",)) and not kw.get("help")]
    assert len({prog for prog, _, _ in calls}) >= len(STAGES + TOOLS) and not missing, missing
