"""One experiment's process in the race to log a shared dataset (a spawned process imports it by name)."""

from __future__ import annotations

from typing import Any

from batchlab import tracking
from tests.support import (
    tiny_config,
)


def log_the_dataset_at_once(uri: str, barrier: Any, answers: Any) -> None:
    """One experiment's process: open its run, wait for the others, log the shared dataset."""
    from batchlab.data import build

    cfg = tiny_config(tracking={"enabled": True, "tracking_uri": uri})
    tracking.quiet_mlflow()
    try:
        with tracking.run(cfg.tracking, name="racer") as tracker:
            barrier.wait()
            tracker.log_datasets(build(cfg.data)[0], "synthetic")
        answers.put("ok")
    except Exception as err:  # the answer the parent asserts on
        answers.put(f"{type(err).__name__}: {str(err)[:120]}")
