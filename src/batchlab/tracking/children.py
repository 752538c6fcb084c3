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
from batchlab.tracking.backend import resolve_uri, retry_locked
from batchlab.tracking.base import REAPED
from batchlab.tracking.record import download

log = logging.getLogger(__name__)


def _children(client: Any, parent_run_id: str, tag: str, value: str, status: str) -> list[Any]:
    parent = retry_locked(client.get_run, parent_run_id)
    query = (
        f"tags.`mlflow.parentRunId` = '{parent_run_id}' and tags.`{tag}` = '{value}' and attributes.status = '{status}'"
    )
    runs: list[Any] = retry_locked(
        client.search_runs,
        [parent.info.experiment_id],
        filter_string=query,
        order_by=["attributes.start_time ASC"],
        max_results=100,
    )
    return runs


def finished_result(
    cfg: TrackingConfig, parent_run_id: str | None, tag: str, value: str, artifact: str
) -> dict[str, Any] | None:
    """The JSON `artifact` of the first FINISHED child of `parent_run_id` tagged `tag` = `value`;
    None when tracking is off, there is no parent, or no finished child holds it."""
    if not cfg.enabled or parent_run_id is None:
        return None
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    uri = resolve_uri(cfg)
    client = MlflowClient(uri)
    for run in _children(client, parent_run_id, tag, value, "FINISHED"):
        with tempfile.TemporaryDirectory(prefix="batchlab-child-") as tmp:
            try:
                path = download(f"runs:/{run.info.run_id}/{artifact}", tmp, uri)
            except (MlflowException, OSError):  # finished before it stored one (an older batchlab)
                continue
            stored: dict[str, Any] = json.loads(Path(path).read_text())
        return stored
    return None


def end_superseded(cfg: TrackingConfig, parent_run_id: str | None, tag: str, value: str) -> list[str]:
    """End KILLED the RUNNING children of `parent_run_id` tagged `tag` = `value`: attempts of work
    about to run again, whose process died on a machine whose runs this one cannot check (the owner
    checks in lifecycle end the dead attempts of this host). Returns their ids."""
    if not cfg.enabled or parent_run_id is None:
        return []
    from mlflow import MlflowClient

    client = MlflowClient(resolve_uri(cfg))
    ended = []
    for run in _children(client, parent_run_id, tag, value, "RUNNING"):
        run_id = run.info.run_id
        retry_locked(client.set_tag, run_id, REAPED, f"superseded: {tag} {value} runs again")
        retry_locked(client.set_terminated, run_id, "KILLED")
        log.warning("tracking: ended run %s as KILLED: its work (%s) runs again", run_id, value)
        ended.append(run_id)
    return ended
