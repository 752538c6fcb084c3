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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NONE
from prefect.futures import as_completed

import batchlab
from batchlab import atomic, data, orchestration, stages, tracking, validate
from batchlab.config import Config, ConfigError
from batchlab.sweep import groups, progress
from batchlab.sweep.experiment import Experiment, code_hash
from batchlab.training import threads

# the worker's checkout of the repo, when it is not at the path the sweep was started from
WORKER_ROOT_ENV = "BATCHLAB_WORKER_ROOT"
SCHEDULER_TIMEOUT_S = 5  # the whole check: connect, handshake and the scheduler's answer
# what a distributed sweep's MLflow store may be: every worker writes its child runs there
SHARED_STORES = ("http://", "https://", "postgresql", "mysql", "mssql")
# Dask's own variables for its TLS config (distributed.comm.tls.*): the cluster's CA, this client's certificate
TLS_VARIABLES = (
    "DASK_DISTRIBUTED__COMM__TLS__CA_FILE",
    "DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT",
    "DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY",
)


class DaskUnavailable(RuntimeError):
    """The scheduler does not answer, or went away mid-sweep."""


class PrefectRefused(RuntimeError):
    """The Prefect server the sweep's flow reports to refuses this client (its auth string)."""


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
    validate.dask_address(cfg.sweep.dask_address)
    uri = tracking.resolve_uri(cfg.tracking)
    if cfg.tracking.enabled and not uri.startswith(SHARED_STORES):
        raise ConfigError(
            f"sweep.executor: dask needs a tracking server every worker reaches (http(s)://host:port or a "
            f"database URI such as postgresql://...), not {uri!r}; set MLFLOW_TRACKING_URI or tracking.tracking_uri"
        )
    if cfg.tracking.enabled:
        tracking.check_reachable(uri)
    _check_prefect()
    _check_scheduler(str(cfg.sweep.dask_address))
    _check_prefect_is_shared()


def _check_prefect_is_shared() -> None:
    """Without PREFECT_API_URL the sweep would start Prefect's temporary server, which no other
    machine reaches, and each worker, given no API either, starts one of its own for its task runs:
    a uvicorn that lives as long as the worker process and outlives one that is killed (one was
    found still running 40 minutes after its sweep, 230 MB). The tasks carry the sweep's Prefect
    settings to the workers, so setting it here is enough."""
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        raise ConfigError(
            "sweep.executor: dask needs a Prefect server the workers report to: set PREFECT_API_URL "
            "(e.g. http://host:4200/api of a `prefect server start`); without it every worker would start "
            "a temporary server of its own"
        )


def _check_prefect() -> None:
    """A Prefect server started with PREFECT_SERVER_API_AUTH_STRING answers its health check to anyone
    and 401 to the rest without the same string in PREFECT_API_AUTH_STRING: the flow would fail in a
    traceback of Prefect's client. Nothing to check without PREFECT_API_URL (Prefect's temporary server)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL

    api = PREFECT_API_URL.value()
    if not api:
        return
    logging.getLogger("httpx").setLevel(logging.WARNING)  # its line per call would precede the one line
    try:
        with get_client(sync_client=True) as client:
            client.hello()
    except PrefectHTTPStatusError as err:
        status = err.response.status_code
        if status not in (401, 403):
            raise
        why = "requires" if PREFECT_API_AUTH_STRING.value() is None else "refused"
        raise PrefectRefused(
            f"the Prefect server at {api} {why} PREFECT_API_AUTH_STRING ({status} {err.response.reason_phrase}): "
            f"set it to the server's PREFECT_SERVER_API_AUTH_STRING (user:password)"
        ) from None


def _security() -> Any:
    """The client side of Dask's TLS, from Dask's config (distributed.comm.tls.*); empty without one."""
    from distributed.security import Security

    return Security()


async def _count_workers(address: str) -> int:
    from distributed.comm import connect
    from distributed.core import send_recv

    # connect's timeout bounds the TCP connect only (its handshake then waits for ever), and is
    # shorter than the check's: a port nobody listens on ends here, in an OSError
    tls = _security().get_connection_args("client")
    comm = await connect(address, timeout=SCHEDULER_TIMEOUT_S - 1, **tls)
    try:
        return int((await send_recv(comm, op="identity", n_workers=0))["n_workers"])
    finally:
        comm.abort()


def _workers_at(address: str) -> int:
    """How many workers the scheduler at `address` has, asked with a deadline on the whole exchange:
    distributed's Client(timeout=...) waits for ever on a port that takes the connection and never
    answers (a stopped or stuck scheduler)."""

    async def within_deadline() -> int:
        return await asyncio.wait_for(_count_workers(address), SCHEDULER_TIMEOUT_S)

    # a loop of its own in a thread of its own: a Prefect flow's thread may be running one
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, within_deadline()).result()


def _check_scheduler(address: str) -> None:
    from distributed.comm.core import CommClosedError

    within = f"did not answer within {SCHEDULER_TIMEOUT_S} s"
    tls_vars = ", ".join(TLS_VARIABLES)
    if address.startswith("tls://") and not (_security().tls_ca_file and _security().tls_client_cert):
        raise DaskUnavailable(
            f"the Dask scheduler at {address} takes TLS clients only and this one has no certificate: set "
            f"{tls_vars} (Dask's config, distributed.comm.tls.*) to the cluster's CA and a certificate it signed"
        )
    try:
        workers = _workers_at(address)
    except CommClosedError:  # taken, then closed in the handshake; Fatal... or not, by the TLS alert's timing
        raise DaskUnavailable(
            f"the connection to the Dask scheduler at {address} closed in its handshake: a TLS scheduler and this "
            f"client that do not trust each other's certificate (set {tls_vars} to the cluster's CA and a "
            f"certificate it signed), or a tcp:// address for a scheduler that takes tls:// only"
        ) from None
    except TimeoutError:  # before OSError, which it is: only a connection that was taken gets here
        raise DaskUnavailable(
            f"the Dask scheduler at {address} {within} (it took the connection and sent nothing back: a stopped "
            f"or stuck scheduler, or another program's port); restart `dask scheduler` there or fix sweep.dask_address"
        ) from None
    except OSError:
        raise DaskUnavailable(
            f"the Dask scheduler at {address} {within} (nothing took the connection); "
            f"start `dask scheduler` there or fix sweep.dask_address"
        ) from None
    except Exception as err:  # something answered, not in Dask's protocol
        raise DaskUnavailable(
            f"{address} answered, but not as a Dask scheduler ({type(err).__name__}: {err}); "
            f"fix sweep.dask_address (the scheduler's port, 8786 by default)"
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
        progress.finished(done.result())
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
    lost = (FutureCancelledError, OSError)  # OSError: distributed's CommClosedError, a refused reconnect
    try:
        # DaskTaskRunner is a TaskRunner of its own future type, which with_options does not spell
        flow_ = on_cluster.with_options(task_runner=runner)  # type: ignore[arg-type]
        with _without_tracebacks_of(lost):
            return flow_(cfg, todo, paths, parent_run_id, expected(paths))
    except lost as err:
        raise DaskUnavailable(
            f"lost the Dask scheduler at {address} mid-sweep ({type(err).__name__}); the finished experiments "
            f"are kept: run the sweep again to resume"
        ) from None
