"""The classifier the model section describes: a built-in network or your own (model.factory);
saved as a state_dict plus what rebuilds it.

    builtins   the MLP (rows), the CNN (images), the transformer encoder (token sequences)
    factory    model.factory: your own nn.Module, imported and checked on one batch
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchlab import atomic
from batchlab.config import ConfigError, ModelConfig
from batchlab.data import DataError
from batchlab.model.builtins import ACTIVATIONS, builtin

__all__ = ["ACTIVATIONS", "build_model", "load_model", "save_model", "save_torch"]


def build_model(cfg: ModelConfig, input_shape: int | tuple[int, ...], n_classes: int, vocab: int = 0) -> nn.Module:
    """The network for examples of `input_shape` (an int: rows of that many features) and
    `n_classes` classes; `vocab`: token ids 0 .. vocab-1 (token sequences). A model that does not fit
    the data is a ConfigError naming the model key."""
    shape = (input_shape,) if isinstance(input_shape, int) else tuple(input_shape)
    if cfg.factory is not None:
        from batchlab.model.factory import from_factory

        return from_factory(cfg, shape, n_classes)
    try:
        return builtin(cfg, shape, n_classes, vocab)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def save_model(
    path: str | Path, model: nn.Module, cfg: ModelConfig, input_shape: int | tuple[int, ...], class_names: list[str],
    vocab: int = 0,
) -> None:
    """A state_dict plus the config that rebuilds it: loadable with torch.load(weights_only=True)."""
    shape = [input_shape] if isinstance(input_shape, int) else list(input_shape)
    payload = {
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "model_config": cfg.model_dump(),
        "n_features": math.prod(shape),
        "input_shape": shape,
        "vocab": vocab,
        "class_names": list(class_names),
    }
    save_torch(path, payload)


def save_torch(path: str | Path, payload: Any) -> None:
    """torch.save through a buffer, written atomically: the same payload always gives the same bytes.

    torch.save(obj, path) stores the file's name in the zip, and an atomic write saves to a random
    temporary name, so saving to the path would change the bytes (and DVC's hash) on every run.
    """
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    atomic.write_with(path, lambda tmp: tmp.write_bytes(buffer.getvalue()))


def load_model(path: str | Path) -> tuple[nn.Module, list[str]]:
    """The trained model in eval mode, and its class names."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no trained model at {path} (run `batchlab train` or `dvc repro train`)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        class_names = list(payload["class_names"])
        shape = tuple(payload.get("input_shape", [payload["n_features"]]))
        cfg = ModelConfig(**payload["model_config"])
    except Exception as err:
        raise DataError(f"{path} is damaged or not a batchlab model ({type(err).__name__}); "
                        "retrain it: `batchlab train` (or `dvc repro train`)") from err
    model = build_model(cfg, shape, len(class_names), int(payload.get("vocab", 0)))  # a factory's error is its own
    try:
        model.load_state_dict(payload["state_dict"])
    # torch.load alone raises EOFError, UnpicklingError or RuntimeError on damage, with many lines of
    # advice to unpickle arbitrary code; whatever failed, the file is not a model this code wrote
    except Exception as err:
        raise DataError(
            f"{path} is damaged or not a batchlab model ({type(err).__name__}); "
            "retrain it: `batchlab train` (or `dvc repro train`)"
        ) from err
    return model.eval(), class_names
