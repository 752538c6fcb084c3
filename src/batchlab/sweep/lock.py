"""One sweep per folder: a second `batchlab sweep` (or sweep flow) refuses at once, writing nothing."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from batchlab import atomic
from batchlab.paths import Paths


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
