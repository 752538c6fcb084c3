"""Which process owns an MLflow run: its host, pid and the pid's start time.

SIGKILL and the OOM killer leave a run RUNNING for ever; with these tags the next batchlab
command on the same host can tell that the owner is gone and end the run.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import psutil

HOST = "batchlab.owner.host"
PID = "batchlab.owner.pid"
STARTED = "batchlab.owner.started"
# a recycled pid starts after the owner died, which is seconds after the owner started (importing
# mlflow alone takes longer), so start times this close belong to the same process
SAME_START_S = 0.5


def process_started(pid: int) -> float | None:
    """The start time (epoch seconds) of process `pid`, or None when no such process runs."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:  # exited, not yet waited for by its parent
            return None
        return float(process.create_time())
    except psutil.Error:
        return None


def owner_tags(pid: int | None = None) -> dict[str, str]:
    pid = os.getpid() if pid is None else pid
    started = process_started(pid)
    return {HOST: socket.gethostname(), PID: str(pid), STARTED: "" if started is None else f"{started:.2f}"}


def owner_gone(tags: Mapping[str, str]) -> str | None:
    """Why the owner named by `tags` no longer runs, or None when it runs, is unknown, or lives on another host."""
    host, pid_text = tags.get(HOST), tags.get(PID, "")
    if host != socket.gethostname() or not pid_text.isdigit():
        return None
    pid = int(pid_text)
    started = process_started(pid)
    if started is None:
        return f"owner pid {pid} on {host} exited without ending the run (killed?)"
    recorded = tags.get(STARTED, "")
    try:
        recycled = abs(float(recorded) - started) > SAME_START_S
    except ValueError:  # start time unknown: trust the pid
        return None
    if recycled:
        return f"owner pid {pid} on {host} exited without ending the run (killed?); the pid was reused since"
    return None
