"""Where each stage reads and writes: the one map of dvc.yaml's outputs that the stages, the sweep
and the Prefect flows share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Paths:
    """Where each stage reads and writes, relative to the repo root (dvc.yaml uses the same).

    `out` moves models/, reports/ and the checkpoint elsewhere: a sweep gives each experiment its own.
    """

    root: Path = Path(".")
    out: Path | None = None

    @property
    def outputs(self) -> Path:
        return self.root if self.out is None else self.out

    @property
    def data(self) -> Path:
        return self.root / "data" / "prepared"

    @property
    def model(self) -> Path:
        return self.outputs / "models" / "model.pt"

    @property
    def curve_weights(self) -> Path:
        """train.curve_weights: {"steps": [...], "weights": [points, parameters]} at the val points."""
        return self.reports / "curve_weights.pt"

    @property
    def onnx(self) -> Path:
        return self.outputs / "models" / "model.onnx"

    @property
    def checkpoint(self) -> Path:
        return self.outputs / ".batchlab" / "checkpoints" / "train.pt"

    @property
    def reports(self) -> Path:
        return self.outputs / "reports"

    @property
    def run_info(self) -> Path:
        return self.reports / "train.json"
