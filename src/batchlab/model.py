"""The classifier: an MLP built from the model section."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchlab import atomic
from batchlab.config import ModelConfig
from batchlab.data import DataError

ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU}


def build_model(cfg: ModelConfig, n_features: int, n_classes: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = n_features
    for hidden in cfg.hidden_sizes:
        layers += [nn.Linear(width, hidden), ACTIVATIONS[cfg.activation]()]
        if cfg.dropout > 0:
            layers.append(nn.Dropout(cfg.dropout))
        width = hidden
    layers.append(nn.Linear(width, n_classes))
    return nn.Sequential(*layers)


def save_model(path: str | Path, model: nn.Module, cfg: ModelConfig, n_features: int, class_names: list[str]) -> None:
    """A state_dict plus the config that rebuilds it: loadable with torch.load(weights_only=True)."""
    payload = {
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "model_config": cfg.model_dump(),
        "n_features": n_features,
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


def load_model(path: str | Path) -> tuple[nn.Sequential, list[str]]:
    """The trained model in eval mode, and its class names."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no trained model at {path} (run `batchlab train` or `dvc repro train`)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        class_names = list(payload["class_names"])
        model = build_model(ModelConfig(**payload["model_config"]), payload["n_features"], len(class_names))
        model.load_state_dict(payload["state_dict"])
    # torch.load alone raises EOFError, UnpicklingError or RuntimeError on damage, with many lines of
    # advice to unpickle arbitrary code; whatever failed, the file is not a model this code wrote
    except Exception as err:
        raise DataError(
            f"{path} is damaged or not a batchlab model ({type(err).__name__}); "
            "retrain it: `batchlab train` (or `dvc repro train`)"
        ) from err
    return model.eval(), class_names
