"""One sweep per folder: a second `batchlab sweep` (or sweep flow) refuses at once, writing nothing;
and one copy of an experiment at a time: a second copy of its task waits for the first (claimed)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
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
def _held(path: Path, holder: str, busy: Callable[[str], None]) -> Iterator[None]:
    """Hold a kernel lock on the file `path`, with `holder` written there. While another process
    holds it, `busy` is called with what that one wrote: it raises to refuse, or returns to try
    again CLAIM_POLL_S later. The kernel frees the lock when its holder dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # no O_TRUNC: the holder's text stays readable
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                busy(os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown")
                time.sleep(CLAIM_POLL_S)
        with atomic.naming(path):  # no space left for the holder's text: the error names the lock
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder.encode(), 0)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def exclusive(paths: Paths) -> Iterator[None]:
    """Hold this folder's sweep lock, or refuse at once: two sweeps at once would train the same
    experiments, resume from each other's half-written checkpoints and open two parent runs."""
    path = lock_path(paths)

    def refuse(owner: str) -> None:
        raise SweepBusy(f"another sweep is running in this folder (pid {owner}, lock {path}); wait for it or stop it")

    with _held(path, f"{os.getpid()}\n", refuse):
        yield


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
    told: list[str] = []

    def wait(owner: str) -> None:  # said once, then waited for quietly
        if not told:
            log.warning("sweep: %s is claimed by another copy of its task (%s); waiting for it", name, owner)
            told.append(owner)

    with _held(path, f"pid {os.getpid()} on {socket.gethostname()}\n", wait):
        yield
