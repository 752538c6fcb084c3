"""The sweep's tasks: each measurement it makes is a keyed task of one of these kinds, planned by
the sweep (sweep/run.py), run by its executor (executors.py: local lanes or Dask) through
groups.train_work, stored, then read by its report; and the Lane every task runs in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchlab.config import Config
from batchlab.paths import Paths
from batchlab.sweep.plan import Experiment, folder_of
from batchlab.training.throughput import Table

# work items' result rows, by experiment name
Results = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class Lane:
    """Where a sweep's experiments train and are recorded: its config, its folders (on this machine
    or this Dask worker), its parent MLflow run and its clock: the throughput table every
    experiment's speed is read from (sweep/speeds.py; None: each its own epochs')."""

    cfg: Config
    paths: Paths
    parent_run_id: str | None = None
    clock: Table | None = None
    tags: dict[str, str] = field(default_factory=dict)  # every child run's: run.origin_tags

    def folder(self, exp: Experiment) -> Paths:
        return folder_of(self.paths, exp)


@dataclass(frozen=True)
class Experiments:
    """A task of the sweep: one experiment, or the seeds of one batch size and lr multiplier trained
    together (decided once for the whole sweep: groups.groups)."""

    experiments: tuple[Experiment, ...]

    @property
    def name(self) -> str:
        return "+".join(exp.name for exp in self.experiments)

    def __len__(self) -> int:
        return len(self.experiments)


@dataclass(frozen=True)
class Branches:
    """A task of the sweep: seeds' local-CBS branches (sweep/branches.py), no experiment. `together`:
    the sweep's one answer to whether its seeds train together (then one task holds them all)."""

    seeds: tuple[int, ...]
    together: bool

    @property
    def name(self) -> str:
        return "local-cbs-" + "+".join(f"seed{seed}" for seed in self.seeds)


@dataclass(frozen=True)
class Clock:
    """A task of the sweep: its throughput table, `batch_sizes` timed side by side (sweep/speeds.py),
    stored under `key` (planned by the sweep: what a step's speed depends on)."""

    batch_sizes: tuple[int, ...]
    key: str

    @property
    def name(self) -> str:
        return "clock"


@dataclass(frozen=True)
class Truth:
    """A task of the sweep: the exact noise scale at `steps` of one experiment's kept weights
    (sweep/truth.py), stored under `key` (the experiment's); the weights after `keep` go."""

    experiment: str  # its name: its folder (folder_named)
    key: str
    steps: tuple[int, ...]
    keep: int

    @property
    def name(self) -> str:
        return f"truth-{self.experiment}"


# what an executor runs (groups.train_work dispatches on the kind): the sweep's measurements, each a
# keyed task whose result is stored; run.finish reads only what they stored
Work = Experiments | Branches | Clock | Truth
