"""What a tracked run recorded, read back for `batchlab reproduce`: tags, params, latest metrics, and
the weights of the torch model train logged."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchlab.data import DataError
from batchlab.tracking.backend import retry_locked

if TYPE_CHECKING:
    import torch

# the name train logs its torch model under (MlflowTracker.log_torch_model); "model" before 2026-12
TORCH_MODELS = ("torch_model", "model")


def download(artifact_uri: str, dst: str | Path, tracking_uri: str | None = None) -> Path:
    """A local copy of a run's or model's artifacts, without MLflow's progress bars on stderr."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow

    return Path(
        mlflow.artifacts.download_artifacts(artifact_uri=artifact_uri, dst_path=str(dst), tracking_uri=tracking_uri)
    )


def run_models(client: Any, run_id: str, name: str | None = None) -> list[Any]:
    """The models a run logged (MLflow 3 LoggedModels), `name`d ones only if given, oldest first."""
    run = retry_locked(client.get_run, run_id)
    where = f"source_run_id = '{run_id}'" + (f" AND name = '{name}'" if name else "")
    found = client.search_logged_models(experiment_ids=[run.info.experiment_id], filter_string=where)
    return sorted(found, key=lambda m: (m.name, m.creation_timestamp))


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    tags: dict[str, str]
    params: dict[str, str]
    metrics: dict[str, float]
    experiment_id: str


def run_record(run_id: str, tracking_uri: str) -> RunRecord:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        run = retry_locked(MlflowClient(tracking_uri).get_run, run_id)
    except MlflowException as err:
        raise DataError(f"run {run_id}: {str(err.message).splitlines()[0]} (tracking store {tracking_uri})") from None
    data = run.data
    return RunRecord(run_id, dict(data.tags), dict(data.params), dict(data.metrics), run.info.experiment_id)


def torch_weights(record: RunRecord, tracking_uri: str) -> dict[str, torch.Tensor] | None:
    """The state dict of the run's torch model (MLflow 3 stores it as a torch.export program: loading it
    runs no pickled code); None when the run logged none in that form."""
    import mlflow
    import torch

    client = mlflow.MlflowClient(tracking_uri)
    found = [m for name in TORCH_MODELS for m in run_models(client, record.run_id, name)][-1:]
    if not found:
        return None
    with tempfile.TemporaryDirectory(prefix="batchlab-reproduce-") as tmp:
        local = Path(
            mlflow.artifacts.download_artifacts(
                artifact_uri=found[0].artifact_location, dst_path=tmp, tracking_uri=tracking_uri
            )
        )
        programs = sorted(local.rglob("*.pt2"))
        if not programs:
            return None
        return {k: v.detach().clone() for k, v in torch.export.load(str(programs[0])).state_dict.items()}
