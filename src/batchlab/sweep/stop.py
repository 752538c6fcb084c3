"""An interrupted or failed Dask sweep stops the experiments it started on the workers.

Dask cannot cancel a task that runs: its worker runs it to the end in one of its threads. So a
sweep stopped by Ctrl-C or SIGTERM went on training on the cluster, into the sweep's folder and its
MLflow runs, and a rerun raced it. Each task registers its thread under its sweep's id
(`registered`); an interrupted or failed sweep asks every worker (`Client.run`) to raise
tracking.Interrupted in those threads (`interrupt`), as SIGTERM does in `batchlab train`: the
experiment's run ends KILLED and its checkpoint is kept for the rerun. A worker's thread runs one
task after another: the exception is set while the thread is still registered (under the guard),
and one not raised by the time its task ends is cleared, so it never lands in the next task. Each
thread is told once: the exception can land in the context manager's own exit, before the thread
is taken off the register, and a second interrupt would then reach it in its next task.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import uuid
from collections.abc import Iterator

log = logging.getLogger(__name__)

# the threads of this worker process running each sweep's tasks, by sweep id
_RUNNING: dict[str, set[int]] = {}
_GUARD = threading.Lock()
REACH_S = 10.0  # the scheduler's answer, at most: an interrupted sweep does not hang on a stuck one


def new_id() -> str:
    return uuid.uuid4().hex


@contextlib.contextmanager
def registered(sweep_id: str) -> Iterator[None]:
    """This thread runs a task of sweep `sweep_id` while the context lasts."""
    ident = threading.get_ident()
    with _GUARD:
        _RUNNING.setdefault(sweep_id, set()).add(ident)
    try:
        yield
    finally:
        with _GUARD:
            _RUNNING.get(sweep_id, set()).discard(ident)
            _set_async(ident, None)  # an interrupt that came too late for this task: not the next's


def interrupt(sweep_id: str) -> int:
    """On a worker (Client.run): raise Interrupted in the threads running sweep `sweep_id`'s tasks,
    at their next Python instruction. How many there were."""
    from batchlab.tracking import Interrupted

    with _GUARD:  # held: a thread leaves its task only after this, so it is still that task's
        idents = sorted(_RUNNING.pop(sweep_id, ()))  # each told once: a second would outlive the task
        for ident in idents:
            _set_async(ident, Interrupted)
    return len(idents)


def _set_async(ident: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in thread `ident` at its next Python instruction; None clears one pending."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None if exc is None else ctypes.py_object(exc))


def stop_tasks(address: str, sweep_id: str) -> int:
    """From the interrupted sweep: every worker's tasks of `sweep_id` interrupted; how many. 0 when
    the scheduler does not answer within REACH_S (its workers then stop with it)."""
    told: list[int] = []

    def ask() -> None:
        from distributed import Client

        with Client(address, timeout=REACH_S, set_as_default=False) as client:
            told.append(sum(client.run(interrupt, sweep_id).values()))

    # a daemon thread: Client(timeout=...) waits for ever on a scheduler that takes the connection
    # and never answers, and the interpreter's exit would wait for a pool's thread
    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    asking.join(REACH_S)
    if told and told[0]:
        log.info("sweep: stopped %d experiment task(s) running on the cluster", told[0])
    return told[0] if told else 0
