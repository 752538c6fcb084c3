"""The sweep on a dask.distributed cluster: one Prefect task run per task of the sweep on a
DaskTaskRunner (sweep/tasks.py: an experiment, or a seed group where the local executor trains a
batch size's seeds together; seeds' branches; the clock; an experiment's truth).

Each task runs the very function the local executor runs (groups.train_work), so results,
MLflow child runs, resume and the report are the same. Before training, a task checks that its
worker runs the same batchlab (version and source) on the same data (content hash), fetching the
data with `dvc pull` when the worker's checkout has none. A worker killed mid-experiment: the
scheduler runs the task again on another worker (distributed.scheduler.allowed-failures), and the
retry continues the killed attempt's checkpoint and MLflow run when it saved one. A task run again
after its experiment finished (Dask runs a task at least once) returns the result that the
experiment's child run stored, training nothing (experiment.stored_result).

A cluster with TLS (a tls:// sweep.dask_address) is reached with Dask's own security config
(distributed.comm.tls.*, e.g. DASK_DISTRIBUTED__COMM__TLS__CA_FILE), which distributed's Client
reads by itself; a Prefect server with an auth string, with Prefect's PREFECT_API_AUTH_STRING.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NONE
from prefect.futures import as_completed

import batchlab
from batchlab import data, orchestration, tracking
from batchlab.paths import Paths
from batchlab.sweep import groups, progress, stop
from batchlab.sweep.plan import code_hash
from batchlab.sweep.preflight import DaskUnavailable, PrefectUnavailable
from batchlab.sweep.tasks import Lane, Results, Work
from batchlab.training import threads

# the worker's checkout of the repo, when it is not at the path the sweep was started from
WORKER_ROOT_ENV = "BATCHLAB_WORKER_ROOT"


class WorkerMismatch(RuntimeError):
    """A worker runs other code or has other data than the sweep: its results would not compare."""


@dataclass(frozen=True)
class Expected:
    """What every worker must have: the sweep's batchlab and data."""

    version: str
    code: str
    data_hash: str


def expected(paths: Paths) -> Expected:
    return Expected(batchlab.__version__, code_hash(), data.load(paths.data).content_hash())


def worker_paths(root: str, outputs: str) -> Paths:
    """The sweep's folders on this worker: its checkout (BATCHLAB_WORKER_ROOT), else the sweep's own path."""
    here = Path(os.environ.get(WORKER_ROOT_ENV) or root)
    return Paths(root=here, out=here / outputs)


def _pull_data(paths: Paths) -> None:
    """The prepared data from the DVC remote, when this worker's checkout has none."""
    target = os.path.relpath(paths.data, paths.root)
    # this interpreter's dvc: a worker's PATH need not hold the environment it runs in
    proc = subprocess.run([sys.executable, "-m", "dvc", "pull", target], cwd=paths.root, capture_output=True, text=True)
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise WorkerMismatch(
            f"worker {socket.gethostname()}: no {paths.data} and `dvc pull {target}` failed ({why}); "
            f"`dvc push` it from the machine that made it, or share the folder ({WORKER_ROOT_ENV})"
        )


def check_worker(want: Expected, paths: Paths) -> None:
    """This worker runs the sweep's code on the sweep's data, or the task fails saying what differs."""
    if not (paths.data / "dataset.json").is_file():
        _pull_data(paths)
    have = expected(paths)
    differ = [
        f"{name} {getattr(have, key)} (sweep: {getattr(want, key)})"
        for key, name in (("version", "batchlab"), ("code", "source hash"), ("data_hash", "data content hash"))
        if getattr(have, key) != getattr(want, key)
    ]
    if differ:
        raise WorkerMismatch(
            f"worker {socket.gethostname()} differs from the sweep: {', '.join(differ)}; "
            f"install the sweep's batchlab commit and `dvc pull` its data on every worker"
        )


def _worker_threads() -> int:
    """The cores of this worker process shared by the experiments it runs at once (its --nthreads)."""
    from distributed import get_worker

    return threads.threads_per_process(get_worker().state.nthreads)


@task(
    name="experiment",
    task_run_name="{name}",
    retries=3,  # a tracking server restarting; a killed worker is the scheduler's retry
    retry_delay_seconds=[10, 30, 60],  # a restarted server's start took 60 s under load here
    retry_condition_fn=orchestration.retry_transient,  # never a WorkerMismatch
    cache_policy=NONE,
)
def experiment(lane: Lane, work: Work, name: str, root: str, outputs: str, want: Expected, sweep_id: str) -> Results:
    """The result rows, by name, of one experiment, or of the seeds of a batch size trained together
    (`name`: the task run's). The worker's own folders replace the lane's: `root` (the sweep's checkout)
    and `outputs` (relative to it) are where they are on the sweep's machine (worker_paths).
    `sweep_id`: what an interrupted sweep names to stop it (stop.py)."""
    here = replace(lane, paths=worker_paths(root, outputs))
    check_worker(want, here.paths)
    threads.limit_cores(_worker_threads())
    threads.use_threads(threads.sweep_threads(here.cfg, data.shape(here.paths.data)))
    with stop.registered(sweep_id):
        return groups.train_work(here, work)


@flow(name="batchlab-sweep-dask", validate_parameters=False)
def on_cluster(lane: Lane, work: list[Work], want: Expected, sweep_id: str) -> dict[str, dict[str, Any]]:
    """Submit every task at once; the scheduler places them on free worker threads. A task is one
    of the sweep's work items (tasks.Work: an experiment, or the seeds of one batch size trained
    together as the local executor groups them; seeds' branches; the clock; an experiment's truth)."""
    paths = lane.paths
    root, outputs = str(paths.root.resolve()), os.path.relpath(paths.outputs, paths.root)
    futures = [experiment.submit(lane, item, item.name, root, outputs, want, sweep_id) for item in work]
    items = {id(future): item for future, item in zip(futures, work, strict=True)}
    results: dict[str, dict[str, Any]] = {}
    for done in as_completed(futures):
        rows = done.result()
        groups.keep(paths, items[id(done)], rows)  # a resume finds it even when the workers' folders are other
        results.update(rows)
        progress.finished(rows)
    return results


class _LostSchedulerTracebacks(logging.Filter):
    """A lost scheduler ends the sweep in one line (DaskUnavailable): the tracebacks of it that
    Prefect (the flow's exception) and distributed (its reconnect, cancelled as the client
    closes) log on the way would bury that line."""

    def __init__(self, lost: tuple[type[BaseException], ...]) -> None:
        super().__init__()
        self.lost = lost

    def filter(self, record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info else None
        if isinstance(err, asyncio.CancelledError):
            return False  # an empty message above a traceback
        if isinstance(err, self.lost):
            record.exc_info = record.exc_text = None  # "Encountered exception ...: FutureCancelledError()" stays
        return True


@contextlib.contextmanager
def _without_tracebacks_of(lost: tuple[type[BaseException], ...]) -> Iterator[None]:
    """On every handler (Prefect's console and API handlers hang on several loggers) while the flow runs."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    handlers = {h for lg in loggers if isinstance(lg, logging.Logger) for h in lg.handlers}
    quiet = _LostSchedulerTracebacks(lost)
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)


def run(lane: Lane, work: list[Work]) -> dict[str, dict[str, Any]]:
    """The experiments still to do, one Prefect task run each on the cluster at sweep.dask_address."""
    from distributed.client import FutureCancelledError
    from prefect_dask import DaskTaskRunner

    if not work:
        return {}
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per Prefect API call otherwise
    cfg = lane.cfg
    address = str(cfg.sweep.dask_address)
    # the workers log where the sweep's runner would: its resolved URI, not their environment's default
    uri = tracking.resolve_uri(cfg.tracking)
    cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"tracking_uri": uri})})
    lane = replace(lane, cfg=cfg)
    runner = DaskTaskRunner(address=address, client_kwargs={"set_as_default": False})
    lost = (FutureCancelledError, OSError)  # OSError: distributed's CommClosedError, a refused reconnect
    sweep_id = stop.new_id()
    try:
        # DaskTaskRunner is a TaskRunner of its own future type, which with_options does not spell
        # one flow run a phase of the sweep (its clock; experiments and branches; their truth), named so
        flow_ = on_cluster.with_options(task_runner=runner, flow_run_name=phase(work))  # type: ignore[arg-type]
        with _without_tracebacks_of(lost):
            return flow_(lane, work, expected(lane.paths), sweep_id)
    except lost as err:
        raise DaskUnavailable(
            f"lost the Dask scheduler at {address} mid-sweep ({type(err).__name__}); the finished experiments "
            f"are kept: run the sweep again to resume"
        ) from None
    except BaseException as err:
        # interrupted, an experiment failed, or Prefect is gone: Dask would run the others to their end
        stop.stop_tasks(address, sweep_id)
        if not (isinstance(err, Exception) and _unreachable_prefect(err)):
            raise
        from prefect.settings import PREFECT_API_URL

        # Prefect's log sender, flushed at exit, would print its own failure to reach the server below the line
        logging.raiseExceptions = False

        raise PrefectUnavailable(
            f"lost the Prefect server at {PREFECT_API_URL.value()} mid-sweep ({type(err).__name__}); the finished "
            f"experiments are kept: start it again and run the sweep again to resume"
        ) from None


def phase(work: list[Work]) -> str:
    """The flow run's name: the kinds of task it runs, e.g. `sweep-clock`, `sweep-experiments`."""
    return "sweep-" + "+".join(sorted({type(item).__name__.lower() for item in work}))


def _unreachable_prefect(err: BaseException) -> bool:
    """An API call of Prefect's client that found no server, after its retries (PREFECT_CLIENT_MAX_RETRIES)."""
    import httpx

    return any(isinstance(cause, httpx.TransportError) for cause in tracking.outage.causes(err))
