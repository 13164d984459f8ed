"""Atomic outputs: every stage writes under a temporary name beside the target and renames it into
place only when complete, so a killed job never leaves a file a later run mistakes for finished."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from nvg.errors import NvgError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, nbytes: int = 0):
    """Yield a temporary path beside `path`; on success rename it to `path`, on failure remove it.
    `nbytes`: what the file will take, checked against the free space first (one clear error line
    instead of a write that fails halfway)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path.parent).free
    if nbytes > free:
        raise NvgError(f"{path}: needs {nbytes:,} bytes, only {free:,} are free on its filesystem")
    for stale in path.parent.glob(f".{path.name}.tmp*"):  # left by a killed run; one writer per output
        pid = stale.name.rsplit(".tmp", 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            raise NvgError(f"{path}: process {pid} is writing it now ({stale.name}); one writer per output "
                           "(Snakemake's lock ensures it: do not run two workflows in one folder with --nolock)")
        stale.unlink()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def write_json(path, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")
