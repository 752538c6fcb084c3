"""What a Dask sweep checks before any experiment or run starts, each failure one line naming the
fix: the address, a tracking store every worker reaches, the Prefect server (its auth string, and
that there is one), the scheduler (within SCHEDULER_TIMEOUT_S, TLS, workers). cluster.py runs the
sweep."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from batchlab import tracking, validate
from batchlab.config import Config, ConfigError

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


class PrefectUnavailable(RuntimeError):
    """The Prefect server the sweep's flow reports to went away mid-sweep, past its client's retries."""


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
