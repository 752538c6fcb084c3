"""A run's life: opened (or continued) by one command, ended FINISHED, FAILED or KILLED; runs that
a dead process of this host left RUNNING are ended KILLED before a new one opens."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator, Mapping
from typing import Any

from batchlab.config import TrackingConfig
from batchlab.tracking import outage, ownership
from batchlab.tracking.backend import (
    artifact_location,
    check_reachable,
    prepare_backend,
    quick_http_retries,
    resolve_uri,
    retry_locked,
    store_faults,
)
from batchlab.tracking.base import FAILED_ATTEMPT, REAPED, RESUMED_FROM, Resumable, Tracker
from batchlab.tracking.mlflow_tracker import MlflowTracker, log_metrics_batched, metrics_from_rows

log = logging.getLogger(__name__)


def attach(cfg: TrackingConfig, run_id: str) -> Tracker:
    """Log into a run that another process owns (DDP rank 0 inside the launcher's run)."""
    import mlflow

    uri = resolve_uri(cfg)
    quick_http_retries(uri)
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
    for found in retry_locked(client.search_runs, [experiment_id], filter_string=query, max_results=1000):
        run_id = found.info.run_id
        note = ownership.owner_gone(found.data.tags)
        if note is None:
            continue
        rows, status = outage.load_unrecorded(run_id)
        if status is not None:  # it ended while the backend was away: record that end, not a kill
            note = f"ended {status} while the tracking backend was unreachable; recorded later"
            log_metrics_batched(client, run_id, metrics_from_rows(rows))
        retry_locked(client.set_tag, run_id, REAPED, note)
        retry_locked(client.set_terminated, run_id, status or "KILLED")
        outage.unrecorded_path(run_id).unlink(missing_ok=True)
        log.warning("tracking: ended run %s as %s: %s", run_id, status or "KILLED", note)
        ended.append(run_id)
    return ended


def _continuable(client: Any, run_id: str, experiment_id: str) -> bool:
    """A run a resumed training may continue: in this experiment, not deleted, ended unfinished."""
    from mlflow.exceptions import MlflowException

    try:
        found = retry_locked(client.get_run, run_id)
    except MlflowException:
        return False
    info = found.info
    unfinished = info.status in {"KILLED", "FAILED"}
    return unfinished and info.experiment_id == experiment_id and info.lifecycle_stage == "active"


@contextlib.contextmanager
def _tracking_uri(uri: str) -> Iterator[None]:
    """`uri` as MLflow's tracking URI while the context lasts; the user's MLflow variables after.

    Through MLFLOW_TRACKING_URI, which MLflow reads while no URI was set in the process:
    set_tracking_uri also resets MLflow's tracer provider, importing its tracing processors (0.2 s
    of every stage here). A URI set in the process (a notebook's set_tracking_uri) overrides the
    variable: then it is set. mlflow.set_experiment exports MLFLOW_EXPERIMENT_ID, which a process
    started later would take for its store's experiment: it goes back to the user's value too."""
    import mlflow

    previous = {name: os.environ.get(name) for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID")}
    os.environ["MLFLOW_TRACKING_URI"] = uri
    if mlflow.get_tracking_uri() != uri:
        mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _create_where_kept(client: Any, name: str, uri: str) -> None:
    """Create the experiment with its artifacts in the project's mlruns/ when this command runs in a
    copy DVC will delete (backend.artifact_location); MLflow's default otherwise."""
    location = artifact_location(uri)
    if location is None or retry_locked(client.get_experiment_by_name, name) is not None:
        return
    with contextlib.suppress(Exception):  # another queued experiment created it first: it is there
        client.create_experiment(name, artifact_location=location)


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
        yield Tracker()
        return
    uri = resolve_uri(cfg)
    check_reachable(uri)
    with store_faults(uri):  # a full disk or a read-only folder under a SQLite store: one line
        yield from _opened(cfg, uri, run_id, name, parent_run_id, tags, resume)


def _opened(
    cfg: TrackingConfig,
    uri: str,
    run_id: str | None,
    name: str | None,
    parent_run_id: str | None,
    tags: Mapping[str, str] | None,
    resume: Resumable | None,
) -> Iterator[Tracker]:
    import mlflow
    from mlflow.tracking import MlflowClient

    prepare_backend(uri)
    quick_http_retries(uri)
    if cfg.system_metrics:
        mlflow.set_system_metrics_sampling_interval(2)  # default 10 s misses short runs
    with _tracking_uri(uri):
        client = MlflowClient(uri)
        _create_where_kept(client, cfg.experiment, uri)
        experiment = retry_locked(mlflow.set_experiment, cfg.experiment)
        _end_orphans(client, experiment.experiment_id)  # one query: the RUNNING runs of this host
        continuing = resume is not None and _continuable(client, resume.run_id, experiment.experiment_id)
        if continuing and resume is not None:
            run_id = resume.run_id
        owner = ownership.owner_tags()
        finished = False  # a run another command finished (train's, reopened by evaluate and export)
        if run_id:  # owned before it turns RUNNING, so no other command takes it for an orphan
            finished = retry_locked(client.get_run, run_id).info.status == "FINISHED"
            retry_locked(client.log_batch, run_id, tags=[mlflow.entities.RunTag(k, v) for k, v in owner.items()])
        active = retry_locked(
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
        with _ending(tracker, finished):
            yield tracker


@contextlib.contextmanager
def _ending(tracker: MlflowTracker, finished: bool) -> Iterator[None]:
    """End the run FINISHED, FAILED on error, KILLED on Ctrl-C/SIGTERM. A run that was FINISHED before
    this command reopened it stays FINISHED when the command fails (a failed int8 gate fails the
    export, not the trained run): the failure is its `failed_attempt` tag."""
    try:
        yield
    except BaseException as err:
        interrupted = isinstance(err, (KeyboardInterrupt, Interrupted))
        what = "interrupted" if interrupted else f"{type(err).__name__}: {err}"[:5000]
        if finished or not interrupted:
            with contextlib.suppress(Exception):
                tracker.set_tags({FAILED_ATTEMPT if finished else "error": what})
        tracker.end("FINISHED" if finished else "KILLED" if interrupted else "FAILED")
        raise
    else:
        tracker.end("FINISHED")
