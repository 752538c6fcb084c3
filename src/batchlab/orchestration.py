"""What the Prefect flows decide, kept out of flows/ so the flows stay wiring only."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from batchlab import stages, tracking
from batchlab.config import Config, load_config
from batchlab.tracking.outage import unreachable
from batchlab.training import launch

# worth another try: a tracking server that is restarting, a DDP launcher that lost a rank
TRANSIENT = (tracking.TrackingUnavailable, launch.LaunchError, ConnectionError, TimeoutError)


def is_transient(error: BaseException) -> bool:
    # a ConfigError or DataError is none of these: never retried. A tracking server that went away
    # mid-run: MLflow's client raises an MlflowException around the refused connection
    return isinstance(error, TRANSIENT) or unreachable(error)


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's retry_condition_fn: retry transient failures, never a config or data error."""
    try:
        state.result()
    except Exception as error:
        return is_transient(error)
    return False


def generate_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    """Prefect cache key for generate: its inputs, the data section and the code that reads it."""
    return f"generate-{stages.generate_inputs_key(parameters['cfg'])}"


def refresh_generate(cfg: Config, root: str) -> bool:
    """Run generate even on a cache hit when the data on disk was not made from these inputs
    (deleted, or rebuilt from other params since): the cache then stores the fresh result."""
    return not stages.generated_is_current(cfg, stages.Paths(Path(root)))


def resolve(params: str, overrides: dict[str, Any] | None, root: str) -> Config:
    """Load params with overrides (stages.train hands DDP ranks the resolved config itself)."""
    logging.getLogger("batchlab").setLevel(logging.INFO)  # shown in Prefect with PREFECT_LOGGING_EXTRA_LOGGERS
    cfg = load_config(Path(root) / params, overrides)
    return cfg


def metrics_markdown(metrics: dict[str, float], run_id: str | None) -> str:
    # headline figures only; per-class ones stay in the MLflow run
    headline = {k: v for k, v in metrics.items() if "_" not in k or k.endswith(("_macro", "_weighted", "auc"))}
    rows = "\n".join(f"| {k} | {v:.4f} |" for k, v in headline.items())
    return f"**MLflow run:** `{run_id}`\n\n| metric | value |\n|---|---:|\n{rows}\n"
