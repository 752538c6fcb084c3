"""Serve the scheduled deployments from this machine: the pipeline nightly, the sweep weekly.

`make serve` runs this. Schedules are cron strings in BATCHLAB_TIMEZONE (default UTC).
While nothing serves, serve() keeps the schedules paused (pause_on_shutdown), so no runs pile up.
"""

from __future__ import annotations

import os

# Prefect reads its settings on import: pipeline.py's defaults (why: see there), set before it
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

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
    # the UI shows a schedule's time zone only in a tooltip: the description says it in words
    schedule = [
        (
            pipeline,
            "nightly",
            NIGHTLY,
            f"nightly at 02:00 {timezone}: generate -> train -> evaluate -> export from {params}",
        ),
        (
            batch_size_sweep,
            "weekly",
            WEEKLY,
            f"weekly on Sunday at 03:00 {timezone}: batch-size sweep, one MLflow parent run, one child per experiment",
        ),
    ]
    return [
        cast(
            RunnerDeployment,
            flow.to_deployment(
                name=name,
                schedules=[Cron(cron, timezone=timezone)],
                parameters={"params": params, "root": root},
                tags=["batchlab"],
                description=description,
            ),
        )
        for flow, name, cron, description in schedule
    ]


if __name__ == "__main__":
    serve(*deployments())
