"""Progress a user can follow: a tqdm bar (done/total, rate, elapsed and ETA) for each stage, and
`nvg progress`, the state of a workflow from its logs.

In a terminal the bar redraws in place. In a file, which is where Snakemake sends a stage's stderr
(`logs/<rule>.log`), every update is a line of its own, at most one every `FILE_INTERVAL` seconds, so
the last line of a log is always the stage's current state."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

from tqdm import tqdm

FILE_INTERVAL = 10.0  # seconds between lines in a log file


class _Lines:
    """A stream for tqdm that turns its carriage-return redraws into whole lines."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, s: str) -> None:
        s = s.replace("\r", "").strip("\n")
        if s.strip():
            self.stream.write(s + "\n")

    def flush(self) -> None:
        self.stream.flush()


def bar(total: int, desc: str, unit: str = "it", iterable=None) -> tqdm:
    """A progress bar on stderr: `with bar(n, "teacher_topk shard 0", "window") as pb: … pb.update(k)`,
    or over an iterable, `for x in bar(len(xs), "budget_reencode", "tensor", xs)`."""
    tty = sys.stderr.isatty()
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr if tty else _Lines(sys.stderr),
                mininterval=0.1 if tty else FILE_INTERVAL, ascii=not tty, ncols=None if tty else 100, dynamic_ncols=tty)


# ── nvg progress ──────────────────────────────────────────────────────────────────────────────────────

RUNNING_WITHIN = 120.0  # a log written to this recently belongs to a running job


def stage_states(directory: Path, stages: list[str], now: float | None = None) -> list[dict]:
    """One row per job log (`logs/<stage>[.<wildcard>].log`), in pipeline order, or per stage without
    one: status (pending, running, stopped, failed, done), seconds (the benchmark's, for a finished
    job) and the log's last line."""
    now = time.time() if now is None else now
    rows = []
    for stage in stages:
        logs = sorted((directory / "logs").glob(f"{stage}.log")) + sorted((directory / "logs").glob(f"{stage}.*.log"))
        if not logs:
            rows.append({"job": stage, "status": "pending", "seconds": None, "last": ""})
            continue
        for log in logs:
            text = log.read_text(errors="replace")
            lines = [line for line in text.splitlines() if line.strip()]
            bench = directory / "benchmarks" / f"{log.stem}.tsv"
            seconds = None
            if any(line.startswith("nvg: error:") for line in lines):
                status = "failed"
            elif bench.exists() and bench.stat().st_mtime >= log.stat().st_mtime:
                status = "done"
                timings = bench.read_text().splitlines()  # a header, then the job's row: s, h:m:s, …
                seconds = float(timings[-1].split("\t")[0]) if len(timings) > 1 else None
            else:
                status = "running" if now - log.stat().st_mtime < RUNNING_WITHIN else "stopped"
            rows.append({"job": log.stem, "status": status, "seconds": seconds, "last": lines[-1] if lines else ""})
    return rows


def print_states(directory: Path, stages: list[str]) -> None:
    rows = stage_states(directory, stages)
    width = max(len(r["job"]) for r in rows)
    total = 0.0
    for r in rows:
        took = f"{r['seconds']:8.1f} s" if r["seconds"] is not None else " " * 10
        total += r["seconds"] or 0.0
        last = re.sub(r"\s+", " ", r["last"])[:110] if r["status"] != "done" else ""
        print(f"{r['job']:{width}s}  {r['status']:8s} {took}  {last}".rstrip())
    done = sum(r["status"] == "done" for r in rows)
    print(f"{done} of {len(rows)} jobs done, {total:.1f} s in finished jobs ({directory / 'logs'})")
