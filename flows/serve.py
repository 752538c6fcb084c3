"""Serve the scheduled deployments from this machine: the pipeline nightly, the sweep weekly.

`make serve` runs this. Schedules are cron strings in BATCHLAB_TIMEZONE (default UTC).
While nothing serves, serve() keeps the schedules paused (pause_on_shutdown), so no runs pile up.
"""

from __future__ import annotations

import os
from typing import cast

from prefect import serve
from prefect.deployments.runner import RunnerDeployment
from prefect.schedules import Cron

from pipeline import pipeline
from sweep import batch_size_sweep

NIGHTLY = "0 2 * * *"  # the pipeline at 02:00 every day
WEEKLY = "0 3 * * 0"  # the sweep at 03:00 every Sunday


def deployments(params: str = "params.yaml", root: str = ".") -> list[RunnerDeployment]:
    timezone = os.environ.get("BATCHLAB_TIMEZONE", "UTC")
    parameters = {"params": params, "root": root}
    return [
        cast(
            RunnerDeployment,
            pipeline.to_deployment(
                name="nightly",
                schedules=[Cron(NIGHTLY, timezone=timezone)],
                parameters=parameters,
                tags=["batchlab"],
                description="generate -> train -> evaluate -> export from params.yaml",
            ),
        ),
        cast(
            RunnerDeployment,
            batch_size_sweep.to_deployment(
                name="weekly",
                schedules=[Cron(WEEKLY, timezone=timezone)],
                parameters=parameters,
                tags=["batchlab"],
                description="batch-size sweep: one MLflow parent run, one child per experiment",
            ),
        ),
    ]


if __name__ == "__main__":
    serve(*deployments())
