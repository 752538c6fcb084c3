"""A tracking backend that goes away mid-run: how long a run waits for it, and where what it missed is kept.

No mlflow here: mlflow_tracker.py hands in its calls and a probe.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from batchlab import atomic

log = logging.getLogger(__name__)

# how long the end of a run waits, in all, for a tracking backend that went away mid-run
FINAL_WAIT_S = float(os.environ.get("BATCHLAB_TRACKING_WAIT_S", "30"))
PROBE_INTERVAL_S = 1.0
# metrics the backend never took, one JSON file per run; the next command that opens the run sends them
UNRECORDED_DIR = Path(".batchlab") / "unrecorded"

T = TypeVar("T")


def causes(err: BaseException) -> Iterator[BaseException]:
    """`err`, then what it was raised from or while handling, down the chain: MLflow and Prefect
    raise their own errors around the one that failed inside."""
    cause: BaseException | None = err
    while cause is not None:
        yield cause
        cause = cause.__cause__ or cause.__context__


def unreachable(err: BaseException) -> bool:
    """A failure to reach the backend (server or database down), worth retrying later; not a refusal."""
    import requests
    import sqlalchemy.exc

    down = (requests.RequestException, sqlalchemy.exc.OperationalError, ConnectionError)
    return any(isinstance(cause, down) for cause in causes(err))  # MLflow raises MlflowException around them


class Backend:
    """The tracking backend as one run's tracker sees it: answering, or down since a failed write."""

    def __init__(self, uri: str, probe: Callable[[], bool]) -> None:
        self.uri = uri
        self.probe = probe  # answers within ~1 s, True when the backend takes requests
        self.down_since: float | None = None
        self.deadline: float | None = None  # end-of-run writes wait for the backend until then

    def went_down(self, err: BaseException) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            reason = str(err).splitlines()[0][:200]
            log.warning("tracking: %s is unreachable (%s); keeping metrics until it answers", self.uri, reason)

    def came_back(self) -> None:
        if self.down_since is not None:
            log.warning("tracking: %s answers again after %.0f s", self.uri, time.monotonic() - self.down_since)
            self.down_since = None

    def answers(self) -> bool:
        """Cheap while it is up; once a write failed, a probe (a refused connection answers at once,
        where MLflow's own retries would stall an epoch for seconds)."""
        return self.down_since is None or self.probe()

    def wait(self) -> bool:
        """Wait for the backend to answer: FINAL_WAIT_S in all, over every call of one run."""
        if self.deadline is None:
            self.deadline = time.monotonic() + FINAL_WAIT_S
            log.warning("tracking: waiting up to %.0f s for %s to answer", FINAL_WAIT_S, self.uri)
        while time.monotonic() < self.deadline:
            if self.probe():
                return True
            time.sleep(PROBE_INTERVAL_S)
        return False

    def persist(self, call: Callable[[], T]) -> tuple[bool, T | None]:
        """An end-of-run write: while the backend is unreachable wait for it (see `wait`).
        (False, None) when it stayed away; other errors are raised."""
        while self.down_since is None or self.wait():
            try:
                result = call()
            except Exception as err:
                if not unreachable(err):
                    raise
                self.went_down(err)
            else:
                self.came_back()
                return True, result
        return False, None


def unrecorded_path(run_id: str) -> Path:
    return UNRECORDED_DIR / f"{run_id}.json"


def save_unrecorded(run_id: str, uri: str, status: str, metrics: list[dict[str, Any]], not_recorded: list[str]) -> Path:
    path = unrecorded_path(run_id)
    content = {"run_id": run_id, "tracking_uri": uri, "status": status, "not_recorded": not_recorded,
               "metrics": metrics}
    atomic.write_json(path, content)
    return path


def load_unrecorded(run_id: str) -> tuple[list[dict[str, Any]], str | None]:
    """The metrics (key, value, timestamp, step) and the end status an earlier command could not record."""
    path = unrecorded_path(run_id)
    if not path.is_file():
        return [], None
    saved = json.loads(path.read_text())
    return list(saved["metrics"]), saved.get("status")
