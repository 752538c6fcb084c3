"""Prefect flow: generate -> train -> evaluate -> export, the same functions `dvc repro` runs.

`python flows/pipeline.py` runs it once, locally (Prefect starts a temporary server by itself).
"""

from __future__ import annotations

import os

# before prefect reads its settings (on import): with telemetry on, a run on this network-less
# machine printed a ~100-line "database is locked" traceback from the analytics service
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# the temporary server `python flows/pipeline.py` starts took over Prefect's 20 s default on a
# busy 2-core machine, failing a run that would have succeeded
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE
from prefect.runtime import flow_run
from prefect.tasks import exponential_backoff

from batchlab import orchestration, stages
from batchlab.config import Config
from batchlab.paths import Paths

RETRY = {
    "retries": 2,
    "retry_delay_seconds": exponential_backoff(backoff_factor=2),
    "retry_condition_fn": orchestration.retry_transient,
    "cache_policy": NONE,
}


@task(name="generate", cache_key_fn=orchestration.generate_cache_key, persist_result=True)
def generate(cfg: Config, root: str) -> dict[str, Any]:
    return stages.generate(cfg, Paths(Path(root)))


@task(name="train", **RETRY)  # type: ignore[call-overload]
def train(cfg: Config, root: str) -> dict[str, Any]:
    tags = {"prefect.flow_run_id": str(flow_run.id), "prefect.flow_name": str(flow_run.flow_name)}
    paths = Paths(Path(root))
    return stages.train(cfg, paths, tags=tags)


@task(name="evaluate", **RETRY)  # type: ignore[call-overload]
def evaluate(cfg: Config, root: str) -> dict[str, float]:
    return stages.evaluate(cfg, Paths(Path(root)))


@task(name="export", **RETRY)  # type: ignore[call-overload]
def export(cfg: Config, root: str) -> dict[str, Any]:
    return stages.export(cfg, Paths(Path(root)))


@flow(name="batchlab-pipeline", log_prints=True)
def pipeline(params: str = "params.yaml", overrides: dict[str, Any] | None = None, root: str = ".") -> dict[str, Any]:
    """Train, evaluate and export from `params` (paths relative to `root`); overrides as {"train.lr": 0.01}."""
    cfg = orchestration.resolve(params, overrides, root)
    generate.with_options(refresh_cache=orchestration.refresh_generate(cfg, root))(cfg, root)
    info = train(cfg, root)
    metrics = evaluate(cfg, root)
    report = export(cfg, root)
    create_markdown_artifact(
        key="batchlab-test-metrics",
        markdown=orchestration.metrics_markdown(metrics, info.get("run_id")),
        description="Test-split metrics of this run; the MLflow run holds the rest",
    )
    return {"run_id": info.get("run_id"), "metrics": metrics, "onnx_max_abs_diff": report["max_abs_diff"]}


if __name__ == "__main__":
    pipeline()
