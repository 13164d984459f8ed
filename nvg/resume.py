"""Resumable stages' saved state: one safetensors file per run, `<root>/<key>/state.safetensors`, key =
hash of the run's input files (path, size, mtime) and its result-affecting settings, so that a changed
input or setting starts over instead of resuming someone else's run. Tensors plus JSON in the metadata,
written atomically: loading it can run no code, and a killed save leaves the previous state. A stage
deletes the folder once its outputs are written. While a run uses its state it holds `one_run`'s lock, and
`stop_requests` turns SIGINT and SIGTERM into a saved state instead of lost steps."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import threading
from pathlib import Path
from typing import Callable, TypeVar

import torch

from nvg.atomic import atomic_path
from nvg.errors import NvgError
from nvg.hash64 import hash64, hex16

T = TypeVar("T")


def state_file(root: str | Path, inputs: list[Path], settings: dict) -> Path:
    """Where the state of a run on `inputs` with `settings` (only those that change the result) lives."""
    parts = [f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in inputs]
    return Path(root) / hex16(hash64(json.dumps([parts, settings], sort_keys=True).encode())) / "state.safetensors"


def save_state(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Write `tensors` (moved to the CPU) with `meta` as JSON in the metadata."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata={"nvg_state": json.dumps(meta)})


def load_state(path: Path, what: str, restore: Callable[[dict[str, torch.Tensor], dict], T]) -> T:
    """`restore(tensors, meta)` on what `save_state` wrote; a foreign or damaged file, whether reading it
    or restoring from it fails, is one clear error naming it as a `what` state."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["nvg_state"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        return restore(tensors, meta)
    except Exception as e:  # whatever the library or the restore raises: never trusted
        raise NvgError(f"{path}: not a readable {what} state ({type(e).__name__}: {e}); delete it to start over") from None


@contextlib.contextmanager
def one_run(path: Path, what: str):
    """Held while a run reads and writes its state `path`: an exclusive lock on `lock` beside it, which the
    OS releases when the run ends or its process dies, killed or not. A second run on the same inputs and
    settings (a second Snakemake started with --unlock while the first one's job still runs) stops with one
    line instead of training from the same state and writing it, and the stage's log, twice over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise NvgError(f"{path.parent}: a {what} run on these inputs and settings is running now (process "
                           f"{holder}); one run at a time") from None
        except OSError:  # a filesystem that cannot lock (some network mounts): the run goes ahead unguarded
            locked = False
        if locked:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # the lock goes with it


@contextlib.contextmanager
def stop_requests():
    """The signals received while the block runs (a list, empty until one comes): SIGINT (Ctrl-C, which a
    terminal sends to Snakemake and its jobs alike) and SIGTERM (a scheduler's time limit or preemption) are
    recorded instead of killing the process, so that the stage can finish the step under way, save its state
    and stop; a second signal interrupts at once. Outside the main thread, where Python cannot take
    signals, the list stays empty and the signals act as before."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def record(signum, frame):
        if received:
            raise KeyboardInterrupt
        received.append(signum)
    previous = {sig: signal.signal(sig, record) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
