"""Helpers for in-process fits: a tracker that interrupts like Ctrl-C, and a model's weights."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def model_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


class StopAfter:
    """A tracker that interrupts training like Ctrl-C after `epochs` epochs were logged."""

    run_id = None

    def __init__(self, epochs: int) -> None:
        self.epochs = epochs

    def log_epoch(self, metrics: Mapping[str, float], step: int) -> None:
        if step > self.epochs:
            raise KeyboardInterrupt
