"""A sweep's resume state: what an earlier attempt of the same sweep left in sweep/state.json.

The state names the sweep it belongs to (its settings, data and code), its parent MLflow run,
the wall time of earlier attempts and a digest of the results last reported, so an interrupted
sweep resumes under the same parent run, counts its whole wall time, and an up-to-date one
reruns as a no-op. The experiments' own results stay in their result.json (sweep/experiment.py).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchlab import atomic, kept
from batchlab.paths import Paths
from batchlab.sweep.experiment import Experiment
from batchlab.training.throughput import Table


@dataclass
class Sweep:
    experiments: list[Experiment]
    finished: dict[str, dict[str, Any]]
    key: str
    parent_run_id: str | None  # an earlier attempt's parent run (same settings), then the one in use
    wall_seconds: float  # spent by earlier attempts of this sweep (same settings)
    reported: str | None  # digest of the results an earlier attempt reported and logged
    started: float = field(default_factory=time.perf_counter)
    clock: Table | None = None  # the throughput table its seconds are read from (sweep/speeds.py)
    seeds_apart: str | None = None  # why its seeds cannot train together (None: they do), decided once in prepare

    @property
    def todo(self) -> list[Experiment]:
        return [e for e in self.experiments if e.name not in self.finished]

    @property
    def up_to_date(self) -> bool:
        """Every experiment finished and these very results already reported: nothing to run or log."""
        return not self.todo and self.reported == digest(list(self.finished.values()))

    def rows(self, results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        """Every experiment's result row in plan order: finished before, or just now (`results`;
        other tasks' results by their names are not rows)."""
        return [{**self.finished, **results}[e.name] for e in self.experiments]

    def elapsed(self) -> float:
        """Wall seconds of every attempt so far, this one included."""
        return self.wall_seconds + time.perf_counter() - self.started


def digest(results: list[dict[str, Any]]) -> str:
    ordered = sorted(results, key=lambda r: str(r["name"]))
    return hashlib.sha256(json.dumps(ordered, sort_keys=True).encode()).hexdigest()[:16]


def state_path(paths: Paths) -> Path:
    return paths.outputs / "sweep" / "state.json"


def save(
    paths: Paths, sweep: Sweep, wall_seconds: float, attempt_started_at: float | None, reported: str | None
) -> None:
    """`attempt_started_at` is set while an attempt runs: if it is still set when the next one
    starts, the last one was killed (SIGKILL) before it could add its time to `wall_seconds`."""
    state = {
        "sweep": sweep.key,
        "parent_run_id": sweep.parent_run_id,
        "wall_seconds": wall_seconds,
        "attempt_started_at": attempt_started_at,
        "reported": reported,
    }
    atomic.write_json(state_path(paths), state)


def earlier_wall_seconds(state: dict[str, Any], finished: dict[str, dict[str, Any]]) -> float:
    wall = float(state.get("wall_seconds", 0.0))
    killed_at = state.get("attempt_started_at")
    if killed_at is not None:  # a killed attempt counts up to the last experiment it finished
        ends = [r["finished_at"] for r in finished.values() if r.get("finished_at", 0.0) >= killed_at]
        wall += max(ends) - killed_at if ends else 0.0
    return wall


def load(paths: Paths, key: str) -> dict[str, Any]:
    """The state an earlier attempt of sweep `key` left; empty when none, or another sweep's (its
    parent run and wall time are not this one's)."""
    return kept.read(state_path(paths), key, field="sweep") or {}
