"""A parent run's child runs found by a key tag: what a finished child stored, and the unfinished
attempts that a rerun of the same work replaces.

Dask runs a task at least once, not exactly once: a task whose result lived in a dead worker's
memory runs again, and so does one whose worker died between finishing and reporting. A rerun
asks here first, so finished work is neither trained nor recorded twice.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from batchlab.config import TrackingConfig
from batchlab.tracking import outage
from batchlab.tracking.backend import resolve_uri, retry_locked
from batchlab.tracking.base import REAPED
from batchlab.tracking.record import download

log = logging.getLogger(__name__)


def _children(client: Any, parent_run_id: str, tag: str, value: str) -> list[Any]:
    """The children of `parent_run_id` tagged `tag` = `value`, oldest first, whatever their status."""
    parent = retry_locked(client.get_run, parent_run_id)
    query = f"tags.`mlflow.parentRunId` = '{parent_run_id}' and tags.`{tag}` = '{value}'"
    runs: list[Any] = retry_locked(
        client.search_runs,
        [parent.info.experiment_id],
        filter_string=query,
        order_by=["attributes.start_time ASC"],
        max_results=100,
    )
    return runs


def _stored(run_id: str, artifact: str, uri: str) -> dict[str, Any] | None:
    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory(prefix="batchlab-child-") as tmp:
        try:
            path = download(f"runs:/{run_id}/{artifact}", tmp, uri)
        except (MlflowException, OSError):  # finished before it stored one (an older batchlab)
            return None
        stored: dict[str, Any] = json.loads(Path(path).read_text())
    return stored


def finished_or_superseded(
    cfg: TrackingConfig, parent_run_id: str | None, tag: str, value: str, artifact: str
) -> dict[str, Any] | None:
    """The JSON `artifact` of the first FINISHED child of `parent_run_id` tagged `tag` = `value`.
    When there is none, the work is about to run again: its RUNNING attempts (and FINISHED ones
    without the artifact, whose writes the backend did not take) are ended KILLED,
    wherever they ran (the owner checks in lifecycle see only this host's), and None is returned.
    None at once when tracking is off or there is no parent."""
    if not cfg.enabled or parent_run_id is None:
        return None
    from mlflow import MlflowClient

    uri = resolve_uri(cfg)
    client = MlflowClient(uri)
    runs = _children(client, parent_run_id, tag, value)
    for run in runs:
        if run.info.status == "FINISHED" and (stored := _stored(run.info.run_id, artifact, uri)) is not None:
            return stored
    for run in runs:  # RUNNING, or FINISHED without its artifact: the backend went away as it ended
        if run.info.status in ("RUNNING", "FINISHED"):
            retry_locked(client.set_tag, run.info.run_id, REAPED, f"superseded: {tag} {value} runs again")
            retry_locked(client.set_terminated, run.info.run_id, "KILLED")
            outage.unrecorded_path(run.info.run_id).unlink(missing_ok=True)  # what its end could not send
            log.warning("tracking: ended run %s as KILLED: its work (%s) runs again", run.info.run_id, value)
    return None


def end_duplicates(client: Any, parent_run_id: str, tag: str, keep: set[str]) -> list[str]:
    """End KILLED every FINISHED child of `parent_run_id` tagged `tag` whose run is not in `keep`
    (the runs the study's rows name): a copy of an experiment that recorded it a second time, on a
    worker that does not share the sweep's folder and so not its claim (sweep/lock.py). Their ids."""
    parent = retry_locked(client.get_run, parent_run_id)
    query = f"tags.`mlflow.parentRunId` = '{parent_run_id}' and attributes.status = 'FINISHED'"
    runs = retry_locked(client.search_runs, [parent.info.experiment_id], filter_string=query, max_results=10000)
    extra = [r for r in runs if tag in r.data.tags and r.info.run_id not in keep]
    for run in extra:
        value = run.data.tags[tag]
        retry_locked(client.set_tag, run.info.run_id, REAPED, f"duplicate: {tag} {value} was recorded by another run")
        retry_locked(client.set_terminated, run.info.run_id, "KILLED")
        log.warning("tracking: ended run %s as KILLED: a second record of %s %s", run.info.run_id, tag, value)
    return [r.info.run_id for r in extra]


def log_on_children(client: Any, figures: dict[str, dict[str, float]]) -> None:
    """Log `figures` ({child run id: {metric: value}}: what only the whole study knows, such as the
    seconds to the study's target) on each child, where the sweep's view charts them."""
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    for run_id, values in figures.items():
        metrics = [Metric(k, float(v), now, 0) for k, v in values.items() if v is not None and v == v]
        if metrics:
            retry_locked(client.log_batch, run_id, metrics=metrics)
