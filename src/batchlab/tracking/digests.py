"""SHA-256 digests of a run's logged models, recorded on each model (a tag) and checked by `batchlab verify`.

MLflow records no digest of model files. Export records one per file of every model of its run
that has none yet (train's torch model included), so a later change of the stored files shows.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchlab.tracking.backend import retry_locked
from batchlab.tracking.record import download, run_models

DIGEST_TAG = "batchlab.sha256"  # JSON {file path in the model: sha256}
# files MLflow itself adds to a model's folder after it was logged: `registered_model_meta` when a
# registered version is loaded or served. Verify checks what batchlab wrote, not these.
MLFLOW_ADDS = frozenset({"registered_model_meta"})


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _file_digests(artifact_location: str, tracking_uri: str) -> dict[str, str]:
    with tempfile.TemporaryDirectory(prefix="batchlab-digests-") as tmp:
        local = download(artifact_location, tmp, tracking_uri)
        files = {p.relative_to(local).as_posix(): p for p in sorted(local.rglob("*")) if p.is_file()}
        return {name: sha256(p) for name, p in files.items() if name not in MLFLOW_ADDS}


def record(client: Any, run_id: str, tracking_uri: str) -> None:
    """Tag every model of run `run_id` that has no digests yet (MlflowTracker.record_digests calls it)."""
    for model in run_models(client, run_id):
        if DIGEST_TAG not in model.tags:  # recorded once: recording again would bless a change
            digests = json.dumps(_file_digests(model.artifact_location, tracking_uri), sort_keys=True)
            retry_locked(client.set_logged_model_tags, model.model_id, {DIGEST_TAG: digests})


@dataclass
class Check:
    checked: list[str] = field(default_factory=list)  # "model name (id)"
    mismatches: list[str] = field(default_factory=list)
    unrecorded: list[str] = field(default_factory=list)


def check(run_id: str, tracking_uri: str) -> Check:
    """Download every model of the run and compare each file with the digests recorded on the model."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    result = Check()
    for model in run_models(client, run_id):
        label = f"MLflow model {model.name!r} ({model.model_id}) of run {run_id}"
        if DIGEST_TAG not in model.tags:
            result.unrecorded.append(label)
            continue
        recorded: dict[str, str] = json.loads(model.tags[DIGEST_TAG])
        now = _file_digests(model.artifact_location, tracking_uri)
        for name in sorted(recorded.keys() | now.keys()):
            if name not in now:
                result.mismatches.append(f"{label}: {name} is missing")
            elif name not in recorded:
                result.mismatches.append(f"{label}: {name} was added after its digests were recorded")
            elif now[name] != recorded[name]:
                result.mismatches.append(
                    f"{label}: {name} has sha256 {now[name][:12]}…, recorded {recorded[name][:12]}…"
                )
        result.checked.append(label)
    return result
