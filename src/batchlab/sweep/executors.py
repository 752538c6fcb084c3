"""Where a sweep's experiments run, decided once per sweep (`sweep.executor`).

    local  `sweep.parallel` lanes on this machine, each experiment in turn (experiment.run_experiment)
    dask   one Prefect task run per experiment on a dask.distributed cluster (cluster.py)

`for_sweep` checks, before anything runs, what the executor needs; `run` takes the experiments
still to do and returns their result rows by name, as run.finish expects them.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

from batchlab.config import Config
from batchlab.paths import Paths
from batchlab.sweep import groups, progress
from batchlab.sweep.experiment import Experiment

Results = dict[str, dict[str, Any]]
# runs the experiments still to do and returns their result rows by name
Runner = Callable[[Config, list[Experiment], Paths, str | None], Results]


@dataclass(frozen=True)
class Executor:
    name: str
    run: Runner


def run_local(cfg: Config, todo: list[Experiment], paths: Paths, parent_run_id: str | None) -> Results:
    """`sweep.parallel` groups at once on this machine (each in its own process when above one)."""
    with ThreadPoolExecutor(max_workers=cfg.sweep.parallel) as pool:
        # the seeds of one batch size and lr train together (groups.py); alone where they cannot
        together = groups.groups(cfg, todo)
        futures = [pool.submit(groups.run_group, cfg, group, paths, parent_run_id) for group in together]
        results: Results = {}
        for future in as_completed(futures):
            done = future.result()
            results.update(done)
            progress.finished(done)
        return results


def for_sweep(cfg: Config, local: Runner = run_local) -> Executor:
    """The executor sweep.executor names, once its preconditions hold (each failure is one line).
    `local`: how this caller runs experiments here (the sweep flow: as Prefect tasks in lanes)."""
    if cfg.sweep.executor == "dask":
        from batchlab.sweep import cluster

        cluster.preflight(cfg)
        return Executor("dask", cluster.run)
    return Executor("local", local)
