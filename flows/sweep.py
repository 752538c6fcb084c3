"""Prefect flow: the batch-size sweep, one task per measurement it makes (sweep/tasks.py: the clock,
each experiment or batch size whose seeds train together, seeds' branches, each experiment's
truth), `sweep.parallel` at a time."""

from __future__ import annotations

import os

# Prefect reads its settings on import: pipeline.py's defaults (why: see there), set before it
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE
from prefect.futures import PrefectFuture, as_completed
from prefect.tasks import exponential_backoff

from batchlab import orchestration
from batchlab.paths import Paths
from batchlab.sweep import executors, groups, lock, progress
from batchlab.sweep.run import prepare, run_prepared
from batchlab.sweep.tasks import Lane, Work
from batchlab.training import launch
from pipeline import generate  # flows/ is on sys.path when a flow file runs


@task(
    name="experiment",
    task_run_name="{name}",
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    retry_condition_fn=orchestration.retry_transient,
    cache_policy=NONE,
)
def experiment(lane: Lane, work: Work, name: str) -> dict[str, Any]:
    """The result rows of one experiment, or of the seeds of a batch size trained together, by name."""
    return groups.run_work(lane, work)


def in_lanes(lane: Lane, work: list[Work]) -> dict[str, dict[str, Any]]:
    """The local executor as Prefect tasks: `sweep.parallel` lanes, each one work item at a time."""
    futures: list[PrefectFuture[dict[str, Any]]] = []
    for queue in groups.lanes(work, lane.cfg.sweep.parallel):
        previous: list[PrefectFuture[dict[str, Any]]] = []
        for item in queue:  # one lane runs its work items one after another
            future = experiment.submit(lane, item, item.name, wait_for=previous, return_state=False)
            futures.append(future)
            previous = [future]
    results: dict[str, dict[str, Any]] = {}
    for done in as_completed(futures):  # counted as they finish: done / total, the time left
        rows = done.result()
        results.update(rows)
        progress.finished(rows)
    return results


@flow(name="batchlab-sweep", log_prints=True)
def batch_size_sweep(
    params: str = "params.yaml", overrides: dict[str, Any] | None = None, root: str = "."
) -> dict[str, Any]:
    """Train at every sweep.batch_sizes under identical conditions; report the trade-off."""
    paths = Paths(Path(root))
    with lock.exclusive(paths):  # the lock `batchlab sweep` takes: one sweep per folder, flow or CLI
        cfg = orchestration.resolve(params, overrides, root)
        generate.with_options(refresh_cache=orchestration.refresh_generate(cfg, root))(cfg, root)
        launch.apply_stage_threads("sweep", cfg, paths.data)  # as `batchlab sweep` does
        executor = executors.for_sweep(cfg, local=in_lanes)  # sweep.executor: dask runs a subflow on the cluster
        study = prepare(cfg, paths, executor)
        summary = run_prepared(cfg, paths, executor, study)
    create_markdown_artifact(
        key="batchlab-sweep", markdown=f"**MLflow parent run:** `{study.parent_run_id}`\n\n{summary['markdown']}"
    )
    return {k: v for k, v in summary.items() if k != "markdown"}


if __name__ == "__main__":
    batch_size_sweep()
