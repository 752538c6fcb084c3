"""Experiment tracking at the edges. The only module that imports mlflow.

`fit` and the stages receive a `Tracker`; non-zero ranks, unit tests and runs with
tracking disabled get a `NullTracker`, whose methods do nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from batchlab import outage, ownership
from batchlab.config import TrackingConfig

if TYPE_CHECKING:
    from torch import nn

    from batchlab.data import Dataset

log = logging.getLogger(__name__)

CHAMPION = "champion"
WRITE_INTERVAL_S = 1.0
REAPED = "batchlab.reaped"
RESUMED = "batchlab.resumed_at_epoch"
RESUMED_FROM = "batchlab.resumed_from_run"  # when that run could not be continued


class TrackingUnavailable(RuntimeError):
    """The tracking backend cannot be reached; raised before any training starts."""


@dataclass(frozen=True)
class Resumable:
    """The run of an interrupted training, and the epochs its checkpoint holds."""

    run_id: str
    epochs: list[dict[str, float]] = field(default_factory=list)


class Tracker(Protocol):
    @property
    def run_id(self) -> str | None: ...

    def log_params(self, params: Mapping[str, Any]) -> None: ...
    def log_epoch(self, metrics: Mapping[str, float], step: int) -> None: ...
    def log_metrics(self, metrics: Mapping[str, float]) -> None: ...
    def set_tags(self, tags: Mapping[str, str]) -> None: ...
    def log_artifact(self, path: str | Path, folder: str | None = None) -> None: ...
    def log_datasets(self, dataset: Dataset, source: str) -> None: ...
    def log_torch_model(self, model: nn.Module, example: np.ndarray) -> str | None: ...
    def log_onnx_model(self, path: str | Path) -> None: ...
    def register(self, model_uri: str, score: float, metric: str) -> bool: ...
    def flush(self) -> None: ...


class NullTracker:
    """A tracker that records nothing."""

    run_id: str | None = None

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def log_epoch(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float]) -> None:
        pass

    def set_tags(self, tags: Mapping[str, str]) -> None:
        pass

    def log_artifact(self, path: str | Path, folder: str | None = None) -> None:
        pass

    def log_datasets(self, dataset: Dataset, source: str) -> None:
        pass

    def log_torch_model(self, model: nn.Module, example: np.ndarray) -> str | None:
        return None

    def log_onnx_model(self, path: str | Path) -> None:
        pass

    def register(self, model_uri: str, score: float, metric: str) -> bool:
        return False

    def flush(self) -> None:
        pass


def resolve_uri(cfg: TrackingConfig) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or cfg.tracking_uri


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail within seconds, naming the URI, when the tracking backend does not answer."""
    hint = "start it, or set MLFLOW_TRACKING_URI / tracking.tracking_uri, or set tracking.enabled: false"
    if uri.startswith(("http://", "https://")):
        import requests

        try:
            requests.get(f"{uri.rstrip('/')}/health", timeout=timeout_s).raise_for_status()
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

    from filelock import FileLock
    from mlflow.tracking import MlflowClient

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
        with contextlib.closing(sqlite3.connect(path, timeout=30)) as conn:
            conn.execute("PRAGMA journal_mode=WAL")


def _retry_locked(call: Any, *args: Any, **kwargs: Any) -> Any:
    """SQLite says 'database is locked' when another process holds the write lock too long."""
    for attempt in range(8):
        try:
            return call(*args, **kwargs)
        except Exception as err:
            if "database is locked" not in str(err) or attempt == 7:
                raise
            time.sleep(0.2 * 2**attempt)
    return None


def _quick_http_retries(uri: str) -> None:
    """MLflow retries a refused connection 7 times over about 4 minutes, in every call: training would
    hang while a server restarts. The tracker keeps what it could not write and retries it itself, so
    MLflow's own retries can be short (~3 s). Settings the user exported win."""
    if uri.startswith(("http://", "https://")):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")


def _reachable(uri: str) -> bool:
    try:
        check_reachable(uri, timeout_s=1.0)
        return True
    except TrackingUnavailable:
        return False


def _metrics(rows: list[dict[str, Any]]) -> list[Any]:
    from mlflow.entities import Metric

    return [Metric(m["key"], float(m["value"]), int(m["timestamp"]), int(m["step"])) for m in rows]


def _log_metrics(client: Any, run_id: str, metrics: list[Any]) -> None:
    for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
        _retry_locked(client.log_batch, run_id, metrics=metrics[i : i + 1000])


def git_tags() -> dict[str, str]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, timeout=10).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"git.commit": commit, "git.dirty": str(dirty).lower()}


def dvc_data_hash(lock_path: str | Path = "dvc.lock", out: str = "data/prepared") -> str | None:
    import yaml

    path = Path(lock_path)
    if not path.is_file():
        return None
    stage = (yaml.safe_load(path.read_text()) or {}).get("stages", {}).get("generate", {})
    return next((o.get("md5") for o in stage.get("outs", []) if o.get("path") == out), None)


def environment_tags() -> dict[str, str]:
    import torch

    tags = {"host": socket.gethostname(), "torch.version": torch.__version__, **git_tags()}
    data_hash = dvc_data_hash()
    if data_hash:
        tags["dvc.data_hash"] = data_hash
    return tags


class MlflowTracker:
    """Logs into one MLflow run, by id, so several stages (processes) share a run.

    A backend that goes away mid-run costs no training: epoch metrics wait in memory for a later
    flush, and the end of the run waits outage.FINAL_WAIT_S at most, then keeps the metrics left in a
    file and names what was not recorded in one warning.
    """

    def __init__(self, run_id: str, cfg: TrackingConfig, uri: str | None = None) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        self.run_id = run_id
        self.cfg = cfg
        self.uri = uri or mlflow.get_tracking_uri()
        self.client = MlflowClient(self.uri)
        self._pending: list[Any] = []  # epoch metrics not yet written
        self._last_write = time.monotonic()
        self._recorded: dict[str, int] = {}  # a continued run: the last step each metric has already
        self._backend = outage.Backend(self.uri, probe=lambda: _reachable(self.uri))
        self._not_recorded: list[str] = []
        self._replayed = False

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        batch = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(batch), 100):
            _retry_locked(self.client.log_batch, self.run_id, params=batch[i : i + 100])

    def log_epoch(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._pending += [
            Metric(k, float(v), now, step)
            for k, v in metrics.items()
            if k != "epoch" and step > self._recorded.get(k, -1)
        ]
        # one write per epoch, but at most one per second: a SQLite write costs ~7 ms, which is
        # 20% of a 30 ms epoch (an async write costs as much, through the GIL)
        if time.monotonic() - self._last_write >= WRITE_INTERVAL_S:
            self.flush()

    def flush(self) -> None:
        """Write the epoch metrics not yet written; while the backend is unreachable keep them for later."""
        if self._pending and self._backend.answers():
            try:
                self._write_pending()
            except Exception as err:
                if not outage.unreachable(err):
                    raise
                self._backend.went_down(err)
        self._last_write = time.monotonic()

    def _write_pending(self) -> None:
        while self._pending:  # drop each batch once written: a failure leaves only the rest pending
            batch = self._pending[:1000]  # MLflow takes at most 1000 metrics per batch
            _retry_locked(self.client.log_batch, self.run_id, metrics=batch)
            del self._pending[: len(batch)]
        if self._replayed:  # what an earlier command left is recorded now
            outage.unrecorded_path(self.run_id).unlink(missing_ok=True)
            self._replayed = False
        self._backend.came_back()

    def _persist(self, what: str, call: Callable[..., Any], *args: Any) -> Any:
        """An end-of-run write; when the backend stays away, `what` is named as not recorded."""
        recorded, result = self._backend.persist(lambda: _retry_locked(call, *args))
        if not recorded:
            self._not_recorded.append(what)
        return result

    def log_metrics(self, metrics: Mapping[str, float]) -> None:
        self.log_epoch(metrics, step=0)
        self.flush()

    def set_tags(self, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        _retry_locked(self.client.log_batch, self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, path: str | Path, folder: str | None = None) -> None:
        self._persist(Path(path).name, self.client.log_artifact, self.run_id, str(path), folder)

    def log_datasets(self, dataset: Dataset, source: str) -> None:
        from mlflow.data.numpy_dataset import from_numpy
        from mlflow.entities import DatasetInput, InputTag

        digest = dataset.content_hash()
        inputs = []
        for context in ("train", "val", "test"):
            split = getattr(dataset, context)
            ds = from_numpy(split.x, targets=split.y, name=f"{source}-{context}", digest=digest)
            inputs.append(DatasetInput(ds._to_mlflow_entity(), [InputTag("mlflow.data.context", context)]))
        _retry_locked(self.client.log_inputs, self.run_id, datasets=inputs)

    def _pip_requirements(self) -> list[str]:
        # explicit requirements: inferring them costs ~10 s per model (PITFALLS.md)
        import mlflow
        import torch

        return [f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}", "numpy"]

    def log_torch_model(self, model: nn.Module, example: np.ndarray) -> str | None:
        import mlflow
        import torch
        from mlflow.models import infer_signature

        with torch.no_grad():
            output = model.cpu()(torch.from_numpy(example)).numpy()

        def log_model() -> str:
            with _active(self.run_id):
                info = mlflow.pytorch.log_model(
                    model,
                    name="model",
                    signature=infer_signature(example, output),
                    input_example=example[:5],
                    pip_requirements=self._pip_requirements(),
                )
            return str(info.model_uri)

        uri: str | None = self._persist("the model", log_model)
        return uri

    def log_onnx_model(self, path: str | Path) -> None:
        import mlflow
        import onnx

        def log_model() -> None:
            with _active(self.run_id):
                mlflow.onnx.log_model(
                    onnx.load(str(path)), name="onnx_model", pip_requirements=["onnxruntime", "numpy"]
                )

        self._persist("the ONNX model", log_model)

    def register(self, model_uri: str, score: float, metric: str) -> bool:
        """Register the model; move the champion alias only when `score` beats the champion's."""
        if not self.cfg.registered_model:
            return False
        return bool(self._persist(f"the registration of {model_uri}", self._register, model_uri, score, metric))

    def _register(self, model_uri: str, score: float, metric: str) -> bool:
        import mlflow

        name = self.cfg.registered_model
        version = mlflow.register_model(model_uri, name, tags={metric: f"{score:.6f}", "run_id": self.run_id})
        try:
            champion = self.client.get_model_version_by_alias(name, CHAMPION)
            best = float(champion.tags.get(metric, "-inf"))
        except mlflow.exceptions.MlflowException:
            best = float("-inf")
        if score > best:
            self.client.set_registered_model_alias(name, CHAMPION, version.version)
            return True
        return False

    def replay_unrecorded(self) -> None:
        """Queue the metrics an earlier command could not record in this run (sent with the next flush)."""
        metrics = _metrics(outage.load_unrecorded(self.run_id)[0])
        if metrics:
            log.info("tracking: recording %d metric values an earlier command could not", len(metrics))
            self._pending = metrics + self._pending
            self._replayed = True
            self.flush()

    def skip_recorded_epochs(self) -> None:
        """Epoch steps this run already holds are not written again (a resumed training replays them)."""
        run = _retry_locked(self.client.get_run, self.run_id)
        for key in run.data.metrics:
            history = _retry_locked(self.client.get_metric_history, self.run_id, key)
            self._recorded[key] = max((m.step for m in history), default=-1)
        for m in self._pending:  # queued by replay_unrecorded, not written yet
            self._recorded[m.key] = max(self._recorded.get(m.key, -1), m.step)

    def continue_epochs(self, epochs: list[dict[str, float]]) -> None:
        """A resumed training: record the epochs of its checkpoint that the killed process had not
        written yet; the steps the run holds are not written twice."""
        self.skip_recorded_epochs()
        for row in epochs:
            self.log_epoch(row, step=int(row["epoch"]))
        self.flush()
        self.set_tags({RESUMED: str(len(epochs))})

    def end(self, status: str) -> None:
        """Write what is pending and end the run with `status`; what the backend would not take is
        named in one warning, and the metrics among it are kept in outage.UNRECORDED_DIR."""
        import mlflow

        if self._pending:
            self._backend.persist(self._write_pending)

        def terminate() -> None:
            active = mlflow.active_run()
            if active is not None and active.info.run_id == self.run_id:
                mlflow.end_run(status)  # takes it off the active-run stack first, then tells the backend
            else:
                self.client.set_terminated(self.run_id, status)

        if not self._backend.persist(terminate)[0]:
            self._not_recorded.append(f"the end of the run ({status})")
            active = mlflow.active_run()
            if active is not None and active.info.run_id == self.run_id:
                with contextlib.suppress(Exception):  # off the active-run stack; the backend will not answer
                    mlflow.end_run(status)
        if self._pending or self._not_recorded:
            self._warn_unrecorded(status)

    def _warn_unrecorded(self, status: str) -> None:
        lost = list(self._not_recorded)
        if self._pending:
            rows = [{"key": m.key, "value": m.value, "timestamp": m.timestamp, "step": m.step} for m in self._pending]
            path = outage.save_unrecorded(self.run_id, self.uri, status, rows, lost)
            lost.insert(0, f"{len(rows)} metric values (kept in {path}; the next command opening the run sends them)")
        log.warning(
            "batchlab: warning: tracking backend %s was unreachable; not recorded in run %s: %s",
            self.uri, self.run_id, "; ".join(lost),
        )  # fmt: skip


@contextlib.contextmanager
def _active(run_id: str) -> Iterator[None]:
    """model-logging APIs log into the active run; make ours active without ending it."""
    import mlflow

    active = mlflow.active_run()
    if active is not None and active.info.run_id == run_id:
        yield
        return
    with mlflow.start_run(run_id=run_id):
        yield


def attach(cfg: TrackingConfig, run_id: str) -> Tracker:
    """Log into a run that another process owns (DDP rank 0 inside the launcher's run)."""
    import mlflow

    uri = resolve_uri(cfg)
    _quick_http_retries(uri)
    mlflow.set_tracking_uri(uri)
    tracker = MlflowTracker(run_id, cfg, uri)
    tracker.skip_recorded_epochs()  # a resumed training: the launcher has recorded the checkpoint's epochs
    return tracker


def _end_orphans(client: Any, experiment_id: str) -> list[str]:
    """End as KILLED the RUNNING runs of this experiment whose owner process on this host is gone
    (SIGKILL, the OOM killer); runs of other hosts are never touched. Returns their ids."""
    host = socket.gethostname()
    query = f"attributes.status = 'RUNNING' and tags.`{ownership.HOST}` = '{host}'"
    ended = []
    for found in _retry_locked(client.search_runs, [experiment_id], filter_string=query, max_results=1000):
        run_id = found.info.run_id
        note = ownership.owner_gone(found.data.tags)
        if note is None:
            continue
        rows, status = outage.load_unrecorded(run_id)
        if status is not None:  # it ended while the backend was away: record that end, not a kill
            note = f"ended {status} while the tracking backend was unreachable; recorded later"
            _log_metrics(client, run_id, _metrics(rows))
        _retry_locked(client.set_tag, run_id, REAPED, note)
        _retry_locked(client.set_terminated, run_id, status or "KILLED")
        outage.unrecorded_path(run_id).unlink(missing_ok=True)
        log.warning("tracking: ended run %s as %s: %s", run_id, status or "KILLED", note)
        ended.append(run_id)
    return ended


def _continuable(client: Any, run_id: str, experiment_id: str) -> bool:
    """A run a resumed training may continue: in this experiment, not deleted, ended unfinished."""
    from mlflow.exceptions import MlflowException

    try:
        found = _retry_locked(client.get_run, run_id)
    except MlflowException:
        return False
    info = found.info
    unfinished = info.status in {"KILLED", "FAILED"}
    return unfinished and info.experiment_id == experiment_id and info.lifecycle_stage == "active"


@contextlib.contextmanager
def _tracking_uri(uri: str) -> Iterator[None]:
    """mlflow.set_tracking_uri also exports MLFLOW_TRACKING_URI; put the user's value back after."""
    import mlflow

    previous = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = previous


class Interrupted(BaseException):
    """SIGTERM, raised so that the run can be ended KILLED."""


@contextlib.contextmanager
def run(
    cfg: TrackingConfig,
    *,
    run_id: str | None = None,
    name: str | None = None,
    parent_run_id: str | None = None,
    tags: Mapping[str, str] | None = None,
    enabled: bool = True,
    resume: Resumable | None = None,
) -> Iterator[Tracker]:
    """Open (or re-open, by id) an MLflow run; end it FAILED on error, KILLED on Ctrl-C/SIGTERM.

    First ends the runs that a dead process of this host left RUNNING. `resume`: an interrupted
    training, whose run is continued when it ended unfinished (else a new run opens).
    """
    if not (cfg.enabled and enabled):
        yield NullTracker()
        return
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = resolve_uri(cfg)
    check_reachable(uri)
    prepare_backend(uri)
    _quick_http_retries(uri)
    if cfg.system_metrics:
        mlflow.set_system_metrics_sampling_interval(2)  # default 10 s misses short runs
    with _tracking_uri(uri):
        experiment = _retry_locked(mlflow.set_experiment, cfg.experiment)
        client = MlflowClient(uri)
        _end_orphans(client, experiment.experiment_id)  # one query: the RUNNING runs of this host
        continuing = resume is not None and _continuable(client, resume.run_id, experiment.experiment_id)
        if continuing and resume is not None:
            run_id = resume.run_id
        owner = ownership.owner_tags()
        if run_id:  # owned before it turns RUNNING, so no other command takes it for an orphan
            _retry_locked(client.log_batch, run_id, tags=[mlflow.entities.RunTag(k, v) for k, v in owner.items()])
        active = _retry_locked(
            mlflow.start_run,
            run_id=run_id,
            experiment_id=None if run_id else experiment.experiment_id,
            run_name=name,
            parent_run_id=parent_run_id,
            tags={**(tags or {}), **owner},
            log_system_metrics=cfg.system_metrics,
            nested=mlflow.active_run() is not None,  # a sweep's child inside its parent
        )
        tracker = MlflowTracker(active.info.run_id, cfg, uri)
        tracker.replay_unrecorded()
        if resume is not None:  # the new run of a resumed training holds the checkpoint's epochs too
            tracker.continue_epochs(resume.epochs)
            if continuing:
                log.info("tracking: continuing run %s after epoch %d", tracker.run_id, len(resume.epochs))
            else:
                tracker.set_tags({RESUMED_FROM: resume.run_id})
        try:
            yield tracker
        except (KeyboardInterrupt, Interrupted):
            tracker.end("KILLED")
            raise
        except BaseException as err:
            with contextlib.suppress(Exception):
                tracker.set_tags({"error": f"{type(err).__name__}: {err}"[:5000]})
            tracker.end("FAILED")
            raise
        else:
            tracker.end("FINISHED")
