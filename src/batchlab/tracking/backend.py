"""The tracking backend, before any run opens: where it is, whether it answers and takes this client's
login, a store ready for concurrent writers. Fails in seconds with one line naming the URI (and, for a
refused login, the variable to fix) instead of hanging in a retry loop or a traceback."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from batchlab.config import ConfigError, TrackingConfig
from batchlab.tracking.outage import causes

# MLflow's own variables for a server's login (`mlflow server --app-name basic-auth`): MLflow's client
# reads them (and ~/.mlflow/credentials, MLFLOW_TRACKING_TOKEN), so no credential is in params.yaml,
# the URI or any run
USERNAME, PASSWORD = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"


class TrackingUnavailable(RuntimeError):
    """The tracking backend cannot be reached; raised before any training starts."""


class TrackingRefused(RuntimeError):
    """The tracking server answers but refuses this client's login (401) or access (403): not
    transient, so never retried (orchestration.TRANSIENT does not hold it)."""


def resolve_uri(cfg: TrackingConfig) -> str:
    return at_project_root(os.environ.get("MLFLOW_TRACKING_URI") or cfg.tracking_uri)


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def moved_root() -> Path | None:
    """The project's root when this command runs in a copy of it: `dvc exp run --temp` and `dvc queue`
    run the stages under .dvc/tmp/exps/, a folder DVC deletes afterwards (DVC_ROOT names the project)."""
    root = os.environ.get("DVC_ROOT")
    if not root or Path(root).resolve() == Path.cwd().resolve():
        return None
    return Path(root).resolve()


def at_project_root(uri: str) -> str:
    """A relative SQLite store (the default sqlite:///mlflow.db) in the project's root, not in a copy
    DVC deletes with the runs in it."""
    path, root = _sqlite_path(uri), moved_root()
    return f"sqlite:///{root / path}" if path is not None and not path.is_absolute() and root else uri


def artifact_location(uri: str) -> str | None:
    """Where a new experiment keeps its artifacts when MLflow's default (./mlruns beside the command)
    is in a copy DVC deletes: the project's mlruns/. None otherwise (MLflow's default)."""
    root = moved_root()
    return (root / "mlruns").as_uri() if root is not None and _sqlite_path(uri) is not None else None


def no_credentials_in(uri: str) -> None:
    """An http(s) URI with user:password@ would put the password in params.yaml, in every run's
    tracking.tracking_uri param and in the logs: refused, naming MLflow's variables instead."""
    parts = urlsplit(uri)
    if parts.username is not None or parts.password is not None:
        shown = parts._replace(netloc=f"***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")).geturl()
        raise ConfigError(
            f"the tracking URI {shown} carries a login: remove it from the URI and set {USERNAME} and {PASSWORD} "
            f"(MLflow's variables, which batchlab records nowhere)"
        )


def check_credentials(uri: str, timeout_s: float = 5.0) -> None:
    """A server with MLflow's basic-auth app answers /health to anyone, and 401 to everything else
    without a valid login: ask it for one experiment with the login MLflow's client would send."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    creds = get_default_host_creds(uri)
    once = {"max_retries": 0, "backoff_factor": 0, "timeout": timeout_s, "raise_on_status": False}
    try:
        response = http_request(creds, "/api/2.0/mlflow/experiments/search", "GET", params={"max_results": 1}, **once)
    except MlflowException as err:  # gone since its /health answered
        why = err.message.splitlines()[0]
        raise TrackingUnavailable(f"MLflow tracking server {uri} is unreachable ({why})") from None
    if response.status_code == 401 and not (creds.username and creds.password) and not creds.token:
        raise TrackingRefused(
            f"MLflow tracking server {uri} requires a login (401 Unauthorized): set {USERNAME} and {PASSWORD} "
            f"to an account on it"
        )
    if response.status_code == 401:
        raise TrackingRefused(
            f"MLflow tracking server {uri} refused the login of user {creds.username!r} (401 Unauthorized): "
            f"check {USERNAME} and {PASSWORD}"
        )
    if response.status_code == 403:
        raise TrackingRefused(
            f"MLflow tracking server {uri} denies user {creds.username!r} access (403 Forbidden): ask its admin "
            f"for a permission, or set {USERNAME} and {PASSWORD} to another account"
        )


def check_reachable(uri: str, timeout_s: float = 5.0, login: bool = True) -> None:
    """Fail within seconds, naming the URI, when the tracking backend does not answer, or (`login`)
    refuses this client's credentials."""
    hint = "start it, or set MLFLOW_TRACKING_URI / tracking.tracking_uri, or set tracking.enabled: false"
    if uri.startswith(("http://", "https://")):
        import requests

        no_credentials_in(uri)
        try:
            requests.get(f"{uri.rstrip('/')}/health", timeout=timeout_s).raise_for_status()
            if login:
                check_credentials(uri, timeout_s)
        except requests.RequestException as err:
            raise TrackingUnavailable(
                f"MLflow tracking server {uri} is unreachable ({type(err).__name__}); {hint}"
            ) from None
    elif uri.startswith(("postgresql", "mysql")):
        import sqlalchemy

        try:
            engine = sqlalchemy.create_engine(uri, connect_args={"connect_timeout": int(timeout_s)})
            with engine.connect():
                pass
        except Exception as err:  # driver errors have no common base class
            raise TrackingUnavailable(
                f"tracking database {uri} is unreachable: {str(err).splitlines()[0]}; {hint}"
            ) from None


def prepare_backend(uri: str) -> None:
    """Create the store once under a file lock (parallel first use races on migrations) and
    put SQLite in WAL mode with a busy timeout so concurrent writers wait instead of failing."""
    path = _sqlite_path(uri)
    if path is None:
        return
    import sqlite3

    # MLflow logs each SQLite error with its traceback, then raises it: a lock retry_locked waits
    # out, a full disk store_faults turns into one line. The raise is enough
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)

    from filelock import FileLock
    from mlflow.tracking import MlflowClient

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
        with contextlib.closing(sqlite3.connect(path, timeout=30)) as conn:
            conn.execute("PRAGMA journal_mode=WAL")


# what SQLite says when the machine refuses its file, and the OS error that is
_STORE_FAULTS = (("database or disk is full", errno.ENOSPC), ("readonly database", errno.EROFS),
                 ("unable to open database file", errno.EACCES), ("disk I/O error", errno.EIO))


@contextlib.contextmanager
def store_faults(uri: str) -> Iterator[None]:
    """A SQLite store's own failure raised inside (its disk full, its file or folder read-only) is
    raised again as the OSError it is, naming the store's file, so the command's one line says
    where and why (cli.os_error) instead of SQLAlchemy's traceback; any other error passes."""
    path = _sqlite_path(uri)
    try:
        yield
    except Exception as err:
        if path is None or (code := _store_fault(err)) is None:
            raise
        if code == errno.EROFS and not _read_only_mount(path):
            code = errno.EACCES  # the file or its folder, not the filesystem
        raise OSError(code, os.strerror(code), str(path)) from err


def _store_fault(err: BaseException) -> int | None:
    return next((code for cause in causes(err) for needle, code in _STORE_FAULTS if needle in str(cause)), None)


def _read_only_mount(path: Path) -> bool:
    folder = path.absolute().parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)


def retry_locked(call: Any, *args: Any, **kwargs: Any) -> Any:
    """SQLite says 'database is locked' when another process holds the write lock too long. And
    MLflow's store writes a shared row as "look it up, insert it if absent": two runs logging the
    same dataset at once (a sweep's experiments on a cluster) both insert, as do two commands
    tagging the same run at once (each new run ends the dead runs of its host and tags them), and
    the second fails on the unique key (SQLite's "UNIQUE constraint failed", PostgreSQL's
    "duplicate key value violates unique constraint": 40 of 80 such tags in one test). MLflow
    writes each call in one transaction, so tried again, it finds the row the first wrote."""
    for attempt in range(8):
        try:
            return call(*args, **kwargs)
        except Exception as err:
            text = str(err)
            raced = "UNIQUE constraint failed" in text or "duplicate key value violates unique constraint" in text
            if not ("database is locked" in text or raced) or attempt == 7:
                raise
            time.sleep(0.2 * 2**attempt)
    return None


def quick_http_retries(uri: str) -> None:
    """MLflow retries a refused connection 7 times over about 4 minutes, in every call: training would
    hang while a server restarts. The tracker keeps what it could not write and retries it itself, so
    MLflow's own retries can be short (~3 s). Settings the user exported win. And MLflow's two lines at
    the end of each run on a server ("🏃 View run … at:", "🧪 View experiment at:") are off: a stage
    prints one line (`batchlab ui-url` gives the UI's address)."""
    if uri.startswith(("http://", "https://")):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


def preflight(uri: str) -> None:
    """Before a command reads runs (reproduce, verify, predict of a models:/ URI): the backend answers
    within seconds or the command stops with one line, and MLflow's HTTP retries are short."""
    check_reachable(uri)
    quick_http_retries(uri)


def reachable(uri: str) -> bool:
    """Whether the backend answers (an outage's probe): the login was checked before the run opened."""
    try:
        check_reachable(uri, timeout_s=1.0, login=False)
        return True
    except TrackingUnavailable:
        return False


def quiet_mlflow() -> None:
    """mlflow print()s some news past any log level ("Successfully registered model…", "Created
    version…") to a stream it shares with its log handler: switch the stream off and point the
    handler at stderr, so its warnings and errors still show. Called only where mlflow is used."""
    from mlflow.utils import logging_utils

    for handler in logging.getLogger("mlflow").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is logging_utils.MLFLOW_LOGGING_STREAM:
            handler.setStream(sys.stderr)
    logging_utils.disable_logging()


def experiment_and_tags(store_uri: str, name: str) -> tuple[str, list[tuple[str, str]]] | None:
    """The id of the active experiment `name` in an MLflow SQL store, and its tags (key, value),
    read with SQLAlchemy; None when the store or the experiment does not exist (yet), or the store
    is not SQL."""
    if store_uri.startswith("sqlite:///") and not Path(store_uri.removeprefix("sqlite:///")).is_file():
        return None  # connecting would create an empty database file
    import sqlalchemy

    query = sqlalchemy.text("SELECT experiment_id FROM experiments WHERE name = :name AND lifecycle_stage = 'active'")
    tags = sqlalchemy.text("SELECT key, value FROM experiment_tags WHERE experiment_id = :id")
    try:
        engine = sqlalchemy.create_engine(store_uri)
        try:
            with engine.connect() as connection:
                row = connection.execute(query, {"name": name}).first()
                found = [] if row is None else [(k, v) for k, v in connection.execute(tags, {"id": row[0]})]
        finally:
            engine.dispose()
    except Exception:  # no SQL store (a file or http URI), unreachable, or no tables yet
        return None
    return None if row is None else (str(row[0]), found)
