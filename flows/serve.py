"""Serve the scheduled deployments from this machine: the pipeline nightly, the sweep weekly.

`make serve` runs this. Schedules are cron strings in BATCHLAB_TIMEZONE (default UTC).
While nothing serves, serve() keeps the schedules paused (pause_on_shutdown), so no runs pile up.

`python flows/serve.py --pool NAME [--source DIR]` instead stores the same deployments on a
process work pool and exits: a `prefect worker start --pool NAME` on any machine whose checkout
is at DIR (default: this one's path) runs them.
"""

from __future__ import annotations

import argparse
import os
import sys

# Prefect reads its settings on import: pipeline.py's defaults (why: see there), set before it
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

from pathlib import Path
from typing import Any, cast

from prefect import Flow, serve
from prefect.deployments.runner import RunnerDeployment
from prefect.schedules import Cron

from pipeline import pipeline
from sweep import batch_size_sweep

NIGHTLY = "0 2 * * *"  # the pipeline at 02:00 every day
WEEKLY = "0 3 * * 0"  # the sweep at 03:00 every Sunday


def schedule(params: str, timezone: str) -> list[tuple[Flow[..., Any], str, str, str]]:
    """(flow, deployment name, cron, description) of each scheduled deployment."""
    # the UI shows a schedule's time zone only in a tooltip: the description says it in words
    return [
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


def deployments(params: str = "params.yaml", root: str = ".") -> list[RunnerDeployment]:
    timezone = os.environ.get("BATCHLAB_TIMEZONE", "UTC")
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
        for flow, name, cron, description in schedule(params, timezone)
    ]


ENTRYPOINTS = {pipeline.name: "flows/pipeline.py:pipeline", batch_size_sweep.name: "flows/sweep.py:batch_size_sweep"}


def deploy_to_pool(pool: str, source: str, params: str = "params.yaml", root: str = ".") -> list[str]:
    """Store the scheduled deployments on work pool `pool`; a worker runs them from its checkout at
    `source` (the flow code is read from there, as `python flows/serve.py` reads it here)."""
    timezone = os.environ.get("BATCHLAB_TIMEZONE", "UTC")
    names = []
    for flow, name, cron, description in schedule(params, timezone):
        # from_source is sync outside an event loop (its type also allows the coroutine of async callers)
        stored = cast(Flow[..., Any], flow.from_source(source=source, entrypoint=ENTRYPOINTS[flow.name]))
        stored.deploy(
            name=name,
            work_pool_name=pool,
            schedules=[Cron(cron, timezone=timezone)],
            parameters={"params": params, "root": root},
            tags=["batchlab"],
            description=description,
            print_next_steps=False,
        )
        names.append(f"{flow.name}/{name}")
    return names


def deploy_or_say_why(pool: str, source: str) -> int:
    """`--pool`: deploy, or one line on stderr naming what is missing and how to make it (exit 1)."""
    import httpx
    from prefect.settings import PREFECT_API_URL

    try:
        for deployed in deploy_to_pool(pool, source):
            print(f"deployed {deployed} to work pool {pool!r}")
    except ValueError as err:
        if "work pool" not in str(err):
            raise
        print(f"serve.py: error: no work pool {pool!r} on the Prefect server; create it first: "
              f"prefect work-pool create {pool} --type process", file=sys.stderr)  # fmt: skip
        return 1
    except httpx.HTTPError as err:
        print(f"serve.py: error: the Prefect API at {PREFECT_API_URL.value()} did not answer ({err}); start the "
              "server (`prefect server start`) or point PREFECT_API_URL at yours", file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", help="store the deployments on this process work pool instead of serving them")
    parser.add_argument("--source", default=str(Path(__file__).resolve().parents[1]), help="the workers' checkout")
    args = parser.parse_args()
    if args.pool:
        sys.exit(deploy_or_say_why(args.pool, args.source))
    serve(*deployments())
