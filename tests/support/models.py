"""The networks the tests train besides the MLP: a CNN on the digits as images, a transformer on
token sequences, a factory whose BatchNorm keeps its seeds apart, and one whose steps wait."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

IMAGES = {"data": {"source": "digits_images"}, "model": {"name": "cnn", "channels": [4, 8], "dropout": 0.1}}
TOKENS = {
    "data": {"source": "sequences", "samples": 900, "classes": 3},
    "model": {"name": "transformer", "d_model": 16, "heads": 2, "layers": 1, "dropout": 0.1},
}


BATCHNORM = textwrap.dedent(
    """
    from torch import nn

    def build(input_shape, n_classes, width=16):
        return nn.Sequential(nn.Linear(input_shape[0], width), nn.BatchNorm1d(width), nn.ReLU(),
                             nn.Linear(width, n_classes))
    """
)


# An MLP whose training forward waits `pause_ms`, as a step on a busy accelerator holds the host: an
# experiment lasts as long as one of many more epochs while its process sleeps. The fault tests need
# experiments that train for seconds (the faults land while they do) without spending a core on it
# (the chaos test's 150 epochs of the plain MLP were 300 of its 380 CPU-seconds in CI). The
# wait changes no number: without it the same network trains to the same weights.
WAITING = textwrap.dedent(
    """
    import time

    from torch import nn

    class Waiting(nn.Sequential):
        def __init__(self, *layers, pause_ms):
            super().__init__(*layers)
            self.pause_s = pause_ms / 1000

        def forward(self, x):
            if self.training:
                time.sleep(self.pause_s)
            return super().forward(x)

    def build(input_shape, n_classes, width=16, pause_ms=1.0):
        return Waiting(nn.Linear(input_shape[0], width), nn.ReLU(), nn.Linear(width, n_classes), pause_ms=pause_ms)
    """
)


def waiting_model(folder: Path, pause_ms: float) -> dict[str, Any]:
    """WAITING as `folder`'s waiting_mlp.py (a name no package of the repo's shadows); the params'
    model section that trains it."""
    (folder / "waiting_mlp.py").write_text(WAITING)
    return {"factory": "waiting_mlp:build", "kwargs": {"pause_ms": pause_ms}}
