"""The tracker every stage and `fit` receive. This base records nothing: non-zero ranks, unit tests
and runs with tracking off use it as it is (torchtitan's BaseLogger); MlflowTracker overrides it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    from torch import nn

    from batchlab.data import Dataset

CHAMPION = "champion"  # the registry alias of the best model so far
REAPED = "batchlab.reaped"
RESUMED = "batchlab.resumed_at_epoch"
RESUMED_FROM = "batchlab.resumed_from_run"  # when that run could not be continued
FAILED_ATTEMPT = "batchlab.failed_attempt"  # a later command's error in a run it reopened (export's int8 gate)
NOTE = "mlflow.note.content"  # the run's description in the MLflow UI


@dataclass(frozen=True)
class Resumable:
    """The run of an interrupted training, and the epochs its checkpoint holds."""

    run_id: str
    epochs: list[dict[str, float]] = field(default_factory=list)


class Tracker:
    """Records nothing; every member is safe to call."""

    run_id: str | None = None

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def log_epoch(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float]) -> None:
        pass

    def set_tags(self, tags: Mapping[str, str]) -> None:
        pass

    def log_artifact(self, path: str | Path, folder: str | None = None) -> None:
        pass

    def log_table(self, rows: list[dict[str, Any]], artifact_file: str) -> None:
        pass

    def log_dict(self, values: Mapping[str, Any], artifact_file: str) -> None:
        pass

    def log_datasets(self, dataset: Dataset, source: str) -> None:
        pass

    def log_torch_model(self, model: nn.Module, example: np.ndarray) -> str | None:
        return None

    def log_onnx_model(self, path: str | Path) -> None:
        pass

    def log_predictor(self, onnx_path: str | Path, example_rows: np.ndarray) -> str | None:
        """The ONNX model as the `predictor` pyfunc: raw rows in, class and probabilities out; its URI."""
        return None

    def record_digests(self) -> None:
        """A sha256 of every file of every model of the run, for `batchlab verify`."""

    def register(self, model_uri: str, score: float, metric: str) -> bool:
        return False

    def log_on_children(self, figures: dict[str, dict[str, float]]) -> None:
        """Log {child run id: {metric: value}} on this parent's children."""

    def end_duplicates(self, tag: str, keep: set[str]) -> None:
        """End KILLED this parent's FINISHED children tagged `tag` other than the runs in `keep`."""

    def save_view(self, name: str, batch_param: str, batch_tag: str) -> str | None:
        """Save a view of this parent's children grouped by their tag `batch_tag`, charted against
        the param `batch_param` (tracking/views.py); its link."""
        return None

    def flush(self) -> None:
        pass

    def unrecorded(self) -> list[str]:
        """What the backend did not take (it stayed unreachable), once the run has ended."""
        return []
