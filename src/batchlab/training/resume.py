"""A training resumed from its checkpoint continues its MLflow run, so the curves have no break.

The run id lives in a file beside the checkpoint (`train.pt.run`), written when the run opens and
removed when the training finishes. The checkpoint itself belongs to `fit`: read here, never written.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from batchlab import atomic
from batchlab.tracking import Resumable
from batchlab.training.checkpoint import read_summary

log = logging.getLogger(__name__)


def sidecar(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + ".run")


def remember(checkpoint: Path, run_id: str | None) -> None:
    if run_id is not None:
        atomic.write_json(sidecar(checkpoint), {"run_id": run_id})


def forget(checkpoint: Path) -> None:
    sidecar(checkpoint).unlink(missing_ok=True)


def find(checkpoint: Path, fingerprint: str) -> Resumable | None:
    """The run of an interrupted training that `fit` will resume from `checkpoint`, with the epochs
    the checkpoint holds; None when `fit` will start over (no checkpoint, or one for other params)."""
    path = sidecar(checkpoint)
    if not path.is_file():
        return None
    try:
        run_id = str(json.loads(path.read_text())["run_id"])
        saved = read_summary(checkpoint)  # the single file, or the sharded (FSDP) checkpoint's meta
    except (OSError, ValueError, KeyError, RuntimeError) as err:  # a torn or foreign file: start a new run
        log.info("not continuing the previous run: %s is unreadable (%s)", path, err)
        return None
    if saved is None or saved.get("fingerprint") != fingerprint:  # fit's own test for resuming
        return None
    history = saved.get("state", {}).get("history", [])
    return Resumable(run_id=run_id, epochs=[{k: float(v) for k, v in row.items()} for row in history])
