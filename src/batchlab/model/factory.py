"""model.factory: your own network, "module.path:function", called as
function(input_shape=(...), n_classes=K, **model.kwargs).

The module is imported with the repository root first on sys.path, so code under usermodels/ (a DVC
dependency of every stage that builds the model) imports as `usermodels.<name>`; an installed
package works too. What goes wrong is one line naming model.factory: the module does not import,
the name is not callable, the call raises, or the result is no nn.Module giving (batch, K) logits.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchlab.config import ConfigError, ModelConfig


class FactoryError(ConfigError):
    """model.factory cannot give a model; the message is one line naming it and what was wrong."""


def _said(err: BaseException) -> str:
    """An exception as `Type: its first line`."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _import(spec: str, root: Path) -> Any:
    module_name, _, attr = spec.partition(":")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ModuleNotFoundError, or whatever the module's own code raised
        raise FactoryError(f"model.factory {spec!r}: cannot import {module_name!r}: {_said(err)}") from None
    function = getattr(module, attr, None)
    if function is None or not callable(function):
        found = "has no" if function is None else "has a non-callable"
        raise FactoryError(f"model.factory {spec!r}: module {module_name!r} {found} {attr!r}")
    return function


def from_factory(cfg: ModelConfig, input_shape: tuple[int, ...], n_classes: int, root: Path | None = None) -> nn.Module:
    """The user's network, checked on one batch of two zero examples: it must give (2, n_classes)."""
    spec = cfg.factory or ""
    function = _import(spec, (root or Path.cwd()).resolve())
    try:
        model = function(input_shape=tuple(input_shape), n_classes=n_classes, **cfg.kwargs)
    except Exception as err:
        raise FactoryError(f"model.factory {spec!r} raised {_said(err)}") from None
    if not isinstance(model, nn.Module):
        raise FactoryError(f"model.factory {spec!r} returned {type(model).__name__}, not a torch nn.Module")
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros(2, *input_shape))
    except Exception as err:
        batch = ", ".join(map(str, (2, *input_shape)))
        raise FactoryError(f"model.factory {spec!r}: its model fails on a batch of shape ({batch}): "
                           f"{_said(err)}") from None
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, n_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise FactoryError(f"model.factory {spec!r}: its model gives {got} for a batch of 2; it must give logits "
                           f"of shape (batch, {n_classes})")
    return model.train()


def main(argv: list[str]) -> int:
    """`python -m batchlab.model.factory MODEL_JSON SHAPE_JSON N_CLASSES ROOT`: build and check the
    factory's model (what `batchlab validate` runs, away from its own torch-free process)."""
    import json

    cfg = ModelConfig.model_validate_json(argv[0])
    try:
        from_factory(cfg, tuple(json.loads(argv[1])), int(argv[2]), Path(argv[3]))
    except FactoryError as err:
        print(f"batchlab: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
