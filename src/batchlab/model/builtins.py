"""The built-in networks: the MLP over rows, a small CNN over images, a small transformer encoder
over token sequences. None has batch statistics (no BatchNorm), so a row's gradient depends on that
row alone: the exact noise scale and the in-training probe hold for each."""

from __future__ import annotations

import math

import torch
from torch import nn

from batchlab.config import ModelConfig

ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU}


def mlp(cfg: ModelConfig, n_features: int, n_classes: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = n_features
    for hidden in cfg.hidden_sizes:
        layers += [nn.Linear(width, hidden), ACTIVATIONS[cfg.activation]()]
        if cfg.dropout > 0:
            layers.append(nn.Dropout(cfg.dropout))
        width = hidden
    layers.append(nn.Linear(width, n_classes))
    return nn.Sequential(*layers)


def cnn(cfg: ModelConfig, input_shape: tuple[int, ...], n_classes: int) -> nn.Sequential:
    """(N, C, H, W) images: per block a 3x3 conv (same size), the activation and a 2x2 max-pool while
    the image is at least 2 pixels on a side; then dropout and a linear head."""
    channels, height, width = input_shape
    layers: list[nn.Module] = []
    for out in cfg.channels:
        layers += [nn.Conv2d(channels, out, 3, padding=1), ACTIVATIONS[cfg.activation]()]
        if min(height, width) >= 2:
            layers.append(nn.MaxPool2d(2))
            height, width = height // 2, width // 2
        channels = out
    layers.append(nn.Flatten())
    if cfg.dropout > 0:
        layers.append(nn.Dropout(cfg.dropout))
    layers.append(nn.Linear(channels * height * width, n_classes))
    return nn.Sequential(*layers)


class TokenClassifier(nn.Module):
    """(N, T) token ids (float32, as every prepared array): embedding plus learned positions, a
    pre-norm transformer encoder, the mean over positions, a linear head."""

    def __init__(self, cfg: ModelConfig, seq_len: int, vocab: int, n_classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, cfg.d_model)
        self.position = nn.Parameter(torch.randn(seq_len, cfg.d_model) / math.sqrt(cfg.d_model))
        layer = nn.TransformerEncoderLayer(
            cfg.d_model, cfg.heads, dim_feedforward=2 * cfg.d_model, dropout=cfg.dropout,
            activation="gelu" if cfg.activation == "gelu" else "relu", batch_first=True, norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, n_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens.long()) + self.position
        return self.head(self.norm(self.encoder(x)).mean(dim=1))


def builtin(cfg: ModelConfig, input_shape: tuple[int, ...], n_classes: int, vocab: int) -> nn.Module:
    """model.name's network for examples of `input_shape`; a ValueError naming what does not fit."""
    if cfg.name == "mlp":
        if len(input_shape) != 1 or vocab:
            raise ValueError(f"model.name mlp takes rows (N, F); the data's examples have shape {input_shape}: "
                             "use model.name cnn for images, transformer for token sequences")
        return mlp(cfg, input_shape[0], n_classes)
    if cfg.name == "cnn":
        if len(input_shape) != 3:
            raise ValueError(f"model.name cnn takes images (C, H, W); the data's examples have shape {input_shape}")
        return cnn(cfg, input_shape, n_classes)
    if len(input_shape) != 1 or vocab < 2:
        lacks = "" if vocab else " and no vocabulary"
        raise ValueError(f"model.name transformer takes token sequences (data.source sequences, or an .npz with "
                         f"a vocab); the data's examples have shape {input_shape}{lacks}")
    return TokenClassifier(cfg, input_shape[0], vocab, n_classes)
