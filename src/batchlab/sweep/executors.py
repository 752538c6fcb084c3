"""Where a sweep's experiments run, decided once per sweep (`sweep.executor`).

    local  `sweep.parallel` lanes on this machine, each work item in turn (groups.run_work)
    dask   one Prefect task run per experiment on a dask.distributed cluster (cluster.py)

`for_sweep` checks, before anything runs, what the executor needs; `run` takes the work items
still to do (groups.groups: the experiments, alone or with their seeds) and returns their result
rows by name, as run.finish expects them.

The local executor stops what it starts: on Ctrl-C, SIGTERM or a failed experiment no queued
experiment starts and the running ones' processes are stopped before the sweep exits.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

from batchlab.config import Config
from batchlab.sweep import groups, progress
from batchlab.sweep.tasks import Lane, Results, Work

# runs the work items still to do and returns their result rows by name
Runner = Callable[[Lane, list[Work]], Results]
# a Ctrl-C at a terminal reaches the experiments' processes too: they end on their own within this
ON_THEIR_OWN_S = 5.0
# an experiment's process told to stop ends its MLflow run KILLED and keeps its checkpoint within this
STOP_S = 60.0


@dataclass(frozen=True)
class Executor:
    name: str
    run: Runner


def run_local(lane: Lane, work: list[Work]) -> Results:
    """`sweep.parallel` work items at once on this machine (each in its own process when above one)."""
    results: Results = {}
    if lane.cfg.sweep.parallel == 1:  # in this thread: Ctrl-C and SIGTERM interrupt the training itself
        for item in work:
            done = groups.run_work(lane, item)
            results.update(done)
            progress.finished(done)
        return results
    others = set(multiprocessing.active_children())  # not the lanes': a stop leaves them be
    pool = ThreadPoolExecutor(max_workers=lane.cfg.sweep.parallel)
    futures = [pool.submit(groups.run_work, lane, item) for item in work]
    try:
        for future in as_completed(futures):
            done = future.result()
            results.update(done)
            progress.finished(done)
    except BaseException:
        # a pool thread cannot be interrupted, and it waits on its experiment's process: without this
        # an interrupted (or failed) sweep went on to run every queued experiment before it exited
        _stop(pool, futures, others)
        raise
    finally:
        pool.shutdown(wait=True)
    return results


def _stop(pool: ThreadPoolExecutor, futures: list[Future[Any]], others: set[BaseProcess]) -> None:
    """No queued group starts; a running one's process is told to stop as Ctrl-C would, unless it
    stops on its own first (a terminal's Ctrl-C reached it too: a second signal would cut short its
    run's ending), and is killed if it has not ended within STOP_S. `others`: this process's children
    from before the lanes started, which are not the lanes' to stop."""
    pool.shutdown(wait=False, cancel_futures=True)
    running = [f for f in futures if not f.done()]
    if not wait(running, timeout=ON_THEIR_OWN_S).not_done:
        return

    def lanes() -> list[BaseProcess]:  # threads.in_fresh_process's, one per running group
        return [p for p in multiprocessing.active_children() if p not in others]

    for process in lanes():
        if process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGINT)
    if wait(running, timeout=STOP_S).not_done:
        for process in lanes():
            process.kill()


def for_sweep(cfg: Config, local: Runner = run_local) -> Executor:
    """The executor sweep.executor names, once its preconditions hold (each failure is one line).
    `local`: how this caller runs experiments here (the sweep flow: as Prefect tasks in lanes)."""
    if cfg.sweep.executor == "dask":
        from batchlab.sweep import cluster, preflight

        preflight.preflight(cfg)
        return Executor("dask", cluster.run)
    return Executor("local", local)
