from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from batchlab.data import Dataset
from batchlab.model import load_model, save_model
from batchlab.strategy import Strategy
from batchlab.train import fit
from tests.conftest import tiny_config

CPU = Strategy(torch.device("cpu"))


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_retraining_with_the_same_config_writes_the_same_bytes(tiny_dataset: Dataset, tmp_path: Path) -> None:
    cfg = tiny_config()
    for name in ("one", "two"):
        model = fit(cfg, tiny_dataset, CPU).model
        save_model(tmp_path / name / "model.pt", model, cfg.model, tiny_dataset.n_features, tiny_dataset.class_names)
    assert _md5(tmp_path / "one" / "model.pt") == _md5(tmp_path / "two" / "model.pt")


def test_saved_model_loads_back_with_the_same_outputs(tiny_dataset: Dataset, tmp_path: Path) -> None:
    cfg = tiny_config()
    model = fit(cfg, tiny_dataset, CPU).model
    save_model(tmp_path / "model.pt", model, cfg.model, tiny_dataset.n_features, tiny_dataset.class_names)
    back, class_names = load_model(tmp_path / "model.pt")
    x = torch.from_numpy(tiny_dataset.test.x)
    assert class_names == tiny_dataset.class_names
    assert torch.equal(back(x), model(x))
