"""One sweep per folder: a second `batchlab sweep` (or sweep flow) refuses at once, writing nothing;
and one copy of an experiment at a time: a second copy of its task waits for the first (claimed)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from batchlab import atomic
from batchlab.paths import Paths

log = logging.getLogger(__name__)


class SweepBusy(RuntimeError):
    """Another sweep holds this folder's lock."""


def lock_path(paths: Paths) -> Path:
    # outside sweep/ (a DVC output): the lock file must not change what DVC hashes
    return paths.outputs / ".batchlab" / "sweep.lock"


@contextlib.contextmanager
def exclusive(paths: Paths) -> Iterator[None]:
    """Hold this folder's sweep lock, or refuse at once: two sweeps at once would train the same
    experiments, resume from each other's half-written checkpoints and open two parent runs."""
    path = lock_path(paths)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # no O_TRUNC: the holder's pid stays readable
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise SweepBusy(
                f"another sweep is running in this folder (pid {owner}, lock {path}); wait for it or stop it"
            ) from None
        with atomic.naming(path):  # no space left for the holder's pid: the error names the lock
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock; the kernel releases it too when the process dies


CLAIM_POLL_S = 0.2  # how often a copy waiting for an experiment's claim tries again


def claim_path(paths: Paths, name: str) -> Path:
    # beside the sweep's lock, outside sweep/: DVC hashes sweep/
    return paths.outputs / ".batchlab" / "claims" / f"{name}.lock"


@contextlib.contextmanager
def claimed(paths: Paths, names: Iterable[str]) -> Iterator[None]:
    """Hold the claim of each experiment named while it is looked up, trained and recorded: Dask
    runs a task at least once, and a task rerun while its first copy still runs (a frozen or
    partitioned worker) waits here until that copy has committed or died, then finds the result
    committed and ends without recording (experiment.stored_result), or resumes what the dead one
    left. Claims are taken in name order, so two groups never wait on each other. A claim is a
    kernel lock on a file in the sweep's folder: it holds across the processes and workers that
    share that folder (one machine, or a shared filesystem), and the kernel frees it when its
    holder dies. The wait polls, so an interrupt (stop.py) reaches a waiting task."""
    with contextlib.ExitStack() as held:
        for name in sorted(set(names)):
            held.enter_context(_claim(claim_path(paths, name), name))
        yield


@contextlib.contextmanager
def _claim(path: Path, name: str) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waited:
                    owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                    log.warning("sweep: %s is claimed by another copy of its task (%s); waiting for it", name, owner)
                    waited = True
                time.sleep(CLAIM_POLL_S)
        with atomic.naming(path):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
