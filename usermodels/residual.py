"""An example of your own network: a small residual CNN, not a Sequential, with a normalization layer.

model:
  factory: usermodels.residual:build
  kwargs: {width: 16}
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """x + conv(act(norm(x))): the shape in is the shape out."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(4, width)  # per example: no batch statistics, unlike BatchNorm
        self.conv = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(torch.relu(self.norm(x)))


class ResidualCNN(nn.Module):
    def __init__(self, channels: int, n_classes: int, width: int, blocks: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(channels, width, 3, padding=1)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(blocks)))
        self.head = nn.Linear(width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(x))
        return self.head(features.mean(dim=(2, 3)))  # global average pooling


def build(input_shape: tuple[int, ...], n_classes: int, width: int = 16, blocks: int = 2) -> nn.Module:
    """batchlab calls this with the data's example shape (C, H, W) and the number of classes."""
    if len(input_shape) != 3:
        raise ValueError(f"takes images (C, H, W), got examples of shape {input_shape}")
    return ResidualCNN(input_shape[0], n_classes, width, blocks)
