"""train.curve_weights' file (reports/curve_weights.pt): the weights at each val point of a run, the
one module that reads and trims it (tracked.write_curves writes it). The sweep's truth computes the
exact noise scale at a point's weights through it, without handling a tensor itself."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.utils import vector_to_parameters

from batchlab.config import ModelConfig
from batchlab.data import Dataset
from batchlab.model import build_model, save_torch
from batchlab.training.gns_exact import ExactNoise, exact_at_weights


@dataclass(frozen=True)
class CurveWeights:
    path: Path
    steps: list[int]  # the val points' optimizer steps, in order
    weights: torch.Tensor  # [points, parameters]: the flat weights at each

    @classmethod
    def load(cls, path: Path) -> CurveWeights | None:
        """The file's points, or None where the run kept none."""
        if not path.is_file():
            return None
        saved = torch.load(path, weights_only=True)
        return cls(path, list(saved["steps"]), saved["weights"])

    def keep_first(self, points: int) -> CurveWeights:
        """Only the first `points` val points kept, in the file too (the rest are most of it)."""
        if len(self.steps) <= points:
            return self
        # a clone: a saved slice would keep the whole storage it views
        kept = CurveWeights(self.path, self.steps[:points], self.weights[:points].clone())
        save_torch(self.path, {"steps": kept.steps, "weights": kept.weights})
        return kept

    def exact_at(self, step: int, model: ModelConfig, dataset: Dataset) -> ExactNoise | None:
        """The exact noise scale at the weights of the val point at `step` (gns_exact.exact_at_weights);
        None where the model's rows are coupled by batch statistics."""
        net = build_model(model, dataset.input_shape, dataset.n_classes, dataset.vocab)
        vector_to_parameters(self.weights[self.steps.index(step)], net.parameters())
        return exact_at_weights(net, dataset.train)
