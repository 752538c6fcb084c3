"""The networks the tests train besides the MLP: a CNN on the digits as images, a transformer on
token sequences, and a factory whose BatchNorm keeps its seeds apart."""

from __future__ import annotations

import textwrap

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
