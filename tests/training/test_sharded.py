"""The sharded (DCP) checkpoint in one process, and the config and launcher accepting fsdp.
Two real ranks: tests/training/test_fsdp.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchlab.config import ConfigError, load_config
from batchlab.data import Dataset
from batchlab.training import launch, resume
from batchlab.training.checkpoint import SHARDED_META, latest_epoch, sharded_folder
from batchlab.training.strategy import Strategy
from batchlab.training.support import describe
from batchlab.training.train import fingerprint, fit
from tests.support import REPO, tiny_config
from tests.support.fits import StopAfter, model_weights

SHARDED = Strategy(torch.device("cpu"), sharded=True)  # fsdp at world size 1: DCP checkpoints, no sharding
CFG = tiny_config(model={"dropout": 0.2}, train={"strategy": "fsdp", "epochs": 4})


def _interrupted(dataset: Dataset, checkpoint: Path, epochs: int = 2) -> Path:
    """Train until `epochs` epochs are saved, then stop like Ctrl-C; the newest epoch folder."""
    with pytest.raises(KeyboardInterrupt):
        fit(CFG, dataset, SHARDED, tracker=StopAfter(epochs), checkpoint=checkpoint)  # type: ignore[arg-type]
    newest = latest_epoch(sharded_folder(checkpoint))
    assert newest is not None
    return newest


def test_sharded_checkpoint_resumes_to_the_weights_of_an_unbroken_run(tiny_dataset: Dataset, tmp_path: Path) -> None:
    expected = fit(CFG, tiny_dataset, SHARDED)
    checkpoint = tmp_path / "train.pt"
    newest = _interrupted(tiny_dataset, checkpoint)
    assert newest == tmp_path / "train.dcp" / "epoch-0002"
    assert [p.name for p in (tmp_path / "train.dcp").iterdir()] == ["epoch-0002"]  # epoch 1 removed, no .tmp left
    assert not checkpoint.exists()
    resumed = fit(CFG, tiny_dataset, SHARDED, checkpoint=checkpoint)
    assert [r["epoch"] for r in resumed.history] == [1, 2, 3, 4]
    want, got = model_weights(expected.model), model_weights(resumed.model)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_damaged_sharded_checkpoint_is_set_aside_and_training_starts_fresh(
    tiny_dataset: Dataset, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    expected = fit(CFG, tiny_dataset, SHARDED)
    checkpoint = tmp_path / "train.pt"
    newest = _interrupted(tiny_dataset, checkpoint)
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # a torn write
    result = fit(CFG, tiny_dataset, SHARDED, checkpoint=checkpoint)
    assert [r["epoch"] for r in result.history] == [1, 2, 3, 4]
    want, got = model_weights(expected.model), model_weights(result.model)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert (tmp_path / "train.dcp.damaged" / "epoch-0002" / SHARDED_META).is_file()  # kept for a look
    assert "is damaged" in caplog.text
    assert latest_epoch(tmp_path / "train.dcp") == tmp_path / "train.dcp" / "epoch-0004"  # a good one again


def test_sharded_checkpoint_of_other_params_is_ignored(tiny_dataset: Dataset, tmp_path: Path) -> None:
    checkpoint = tmp_path / "train.pt"
    _interrupted(tiny_dataset, checkpoint)
    other = tiny_config(model={"dropout": 0.2}, train={"strategy": "fsdp", "epochs": 4, "lr": 0.02})
    result = fit(other, tiny_dataset, SHARDED, checkpoint=checkpoint)
    fresh = fit(other, tiny_dataset, SHARDED)
    assert [r["val_loss"] for r in result.history] == [r["val_loss"] for r in fresh.history]


def test_an_interrupted_sharded_training_continues_its_mlflow_run(tiny_dataset: Dataset, tmp_path: Path) -> None:
    checkpoint = tmp_path / "train.pt"
    _interrupted(tiny_dataset, checkpoint)
    resume.remember(checkpoint, "run-1")
    found = resume.find(checkpoint, fingerprint(CFG, tiny_dataset))
    assert found is not None and found.run_id == "run-1" and [e["epoch"] for e in found.epochs] == [1.0, 2.0]
    assert resume.find(checkpoint, "another-fingerprint") is None


def test_fsdp_is_a_strategy_of_many_processes_started_by_torchrun() -> None:
    train = tiny_config(train={"strategy": "fsdp", "nproc": 2, "nnodes": 2, "batch_size": 32}).train
    assert train.world_size() == 4 and launch.uses_torchrun(train)
    assert describe(train)["strategy"] == "fsdp" and describe(train)["world_size"] == "4"
    # the override DVC passes: `dvc exp run -S train.strategy=fsdp -S train.nproc=2`
    cfg = load_config(REPO / "params.yaml", {"train.strategy": "fsdp", "train.nproc": 2})
    assert cfg.train.world_size() == 2
    with pytest.raises(ConfigError, match=r"train.strategy: .*got 'fdsp'"):
        load_config(REPO / "params.yaml", {"train.strategy": "fdsp"})
