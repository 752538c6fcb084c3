"""The sweep on a dask.distributed cluster: one Prefect task run per experiment on a DaskTaskRunner
(per seed group where the local executor trains a batch size's seeds together: groups.py).

Each task runs the very function the local executor runs (groups.train_group), so results,
MLflow child runs, resume and the report are the same. Before training, a task checks that its
worker runs the same batchlab (version and source) on the same data (content hash), fetching the
data with `dvc pull` when the worker's checkout has none. A worker killed mid-experiment: the
scheduler runs the task again on another worker (distributed.scheduler.allowed-failures), and the
retry continues the killed attempt's checkpoint and MLflow run when it saved one. A task run again
after its experiment finished (Dask runs a task at least once) returns the result that the
experiment's child run stored, training nothing (experiment.stored_result).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NONE
from prefect.futures import as_completed

import batchlab
from batchlab import atomic, data, orchestration, stages, tracking
from batchlab.config import Config, ConfigError
from batchlab.sweep import groups
from batchlab.sweep.experiment import Experiment, code_hash
from batchlab.training import threads

# the worker's checkout of the repo, when it is not at the path the sweep was started from
WORKER_ROOT_ENV = "BATCHLAB_WORKER_ROOT"
SCHEDULER_TIMEOUT_S = 5
# what a distributed sweep's MLflow store may be: every worker writes its child runs there
SHARED_STORES = ("http://", "https://", "postgresql", "mysql", "mssql")


class DaskUnavailable(RuntimeError):
    """The scheduler does not answer, or went away mid-sweep."""


class WorkerMismatch(RuntimeError):
    """A worker runs other code or has other data than the sweep: its results would not compare."""


@dataclass(frozen=True)
class Expected:
    """What every worker must have: the sweep's batchlab and data."""

    version: str
    code: str
    data_hash: str


def preflight(cfg: Config) -> None:
    """Fail in seconds, in one line naming the fix, before any experiment or run starts."""
    uri = tracking.resolve_uri(cfg.tracking)
    if cfg.tracking.enabled and not uri.startswith(SHARED_STORES):
        raise ConfigError(
            f"sweep.executor: dask needs a tracking server every worker reaches (http(s)://host:port or a "
            f"database URI such as postgresql://...), not {uri!r}; set MLFLOW_TRACKING_URI or tracking.tracking_uri"
        )
    if cfg.tracking.enabled:
        tracking.check_reachable(uri)
    _check_scheduler(str(cfg.sweep.dask_address))


def _check_scheduler(address: str) -> None:
    from distributed import Client

    try:
        with Client(address, timeout=SCHEDULER_TIMEOUT_S, set_as_default=False) as client:
            workers = client.scheduler_info(n_workers=-1)["workers"]
    except (OSError, TimeoutError) as err:
        raise DaskUnavailable(
            f"the Dask scheduler at {address} did not answer within {SCHEDULER_TIMEOUT_S} s "
            f"({type(err).__name__}); start `dask scheduler` there or fix sweep.dask_address"
        ) from None
    if not workers:  # the experiments would wait for one forever
        raise DaskUnavailable(f"the Dask scheduler at {address} has no workers; start `dask worker {address}`")


def expected(paths: stages.Paths) -> Expected:
    return Expected(batchlab.__version__, code_hash(), data.load(paths.data).content_hash())


def worker_paths(root: str, outputs: str) -> stages.Paths:
    """The sweep's folders on this worker: its checkout (BATCHLAB_WORKER_ROOT), else the sweep's own path."""
    here = Path(os.environ.get(WORKER_ROOT_ENV) or root)
    return stages.Paths(root=here, out=here / outputs)


def _pull_data(paths: stages.Paths) -> None:
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


def check_worker(want: Expected, paths: stages.Paths) -> None:
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
    retries=2,  # a tracking server restarting; a killed worker is the scheduler's retry
    retry_condition_fn=orchestration.retry_transient,  # never a WorkerMismatch
    cache_policy=NONE,
)
def experiment(
    cfg: Config,
    group: list[Experiment],
    name: str,
    root: str,
    outputs: str,
    parent_run_id: str | None,
    want: Expected,
) -> dict[str, Any]:
    """The result rows, by name, of one experiment, or of the seeds of a batch size trained together."""
    paths = worker_paths(root, outputs)
    check_worker(want, paths)
    threads.limit_cores(_worker_threads())
    threads.use_threads(threads.sweep_threads(cfg, data.shape(paths.data)))
    return groups.train_group(cfg, group, paths, parent_run_id)


@flow(name="batchlab-sweep-dask", validate_parameters=False)
def on_cluster(
    cfg: Config, todo: list[Experiment], paths: stages.Paths, parent_run_id: str | None, want: Expected
) -> dict[str, dict[str, Any]]:
    """Submit every task at once; the scheduler places them on free worker threads. A task is one
    experiment, or the seeds of one batch size trained together, as the local executor groups them."""
    root, outputs = str(paths.root.resolve()), os.path.relpath(paths.outputs, paths.root)
    futures = []
    for group in groups.groups(cfg, todo):
        name = "+".join(exp.name for exp in group)
        futures.append(experiment.submit(cfg, group, name, root, outputs, parent_run_id, want))
    results: dict[str, dict[str, Any]] = {}
    for done in as_completed(futures):
        for name, result in done.result().items():
            # kept here too: a resume finds it even when the workers' folders are not this one
            atomic.write_json(paths.outputs / "sweep" / "experiments" / name / "result.json", result)
            results[name] = result
    return results


def run(
    cfg: Config, todo: list[Experiment], paths: stages.Paths, parent_run_id: str | None
) -> dict[str, dict[str, Any]]:
    """The experiments still to do, one Prefect task run each on the cluster at sweep.dask_address."""
    from distributed.client import FutureCancelledError
    from prefect_dask import DaskTaskRunner

    if not todo:
        return {}
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per Prefect API call otherwise
    address = str(cfg.sweep.dask_address)
    # the workers log where the sweep's runner would: its resolved URI, not their environment's default
    uri = tracking.resolve_uri(cfg.tracking)
    cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"tracking_uri": uri})})
    runner = DaskTaskRunner(address=address, client_kwargs={"set_as_default": False})
    try:
        # DaskTaskRunner is a TaskRunner of its own future type, which with_options does not spell
        flow_ = on_cluster.with_options(task_runner=runner)  # type: ignore[arg-type]
        return flow_(cfg, todo, paths, parent_run_id, expected(paths))
    except (FutureCancelledError, OSError) as err:
        raise DaskUnavailable(
            f"lost the Dask scheduler at {address} mid-sweep ({type(err).__name__}); the finished experiments "
            f"are kept: run the sweep again to resume"
        ) from None
