from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from batchlab.data import DataError, Dataset
from batchlab.model import load_model, save_model
from batchlab.training.strategy import Strategy
from batchlab.training.train import fit
from tests.support import tiny_config

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


@pytest.mark.parametrize("damage", ["garbage", "empty", "truncated"])
def test_damaged_model_file_is_one_line_naming_it_and_saying_retrain(
    tiny_dataset: Dataset, tmp_path: Path, damage: str
) -> None:
    cfg = tiny_config(train={"epochs": 1})
    path = tmp_path / "models" / "model.pt"
    save_model(path, fit(cfg, tiny_dataset, CPU).model, cfg.model, tiny_dataset.n_features, tiny_dataset.class_names)
    whole = path.read_bytes()
    path.write_bytes({"garbage": b"not a model", "empty": b"", "truncated": whole[: len(whole) // 2]}[damage])
    with pytest.raises(DataError) as err:
        load_model(path)
    text = str(err.value)
    assert str(path) in text and "batchlab train" in text and "\n" not in text
    assert "weights_only" not in text  # torch's advice to unpickle arbitrary code is wrong here
