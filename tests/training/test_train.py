from __future__ import annotations

import math
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from batchlab.data import Dataset, Split
from batchlab.model import save_torch
from batchlab.training import train
from batchlab.training.optim import make_optimizer, make_schedule
from batchlab.training.strategy import Strategy
from batchlab.training.train import NonFiniteError, fit
from tests.support import tiny_config
from tests.support.fits import StopAfter, model_weights

CPU = Strategy(torch.device("cpu"))


def test_fit_learns_and_records_history(tiny_dataset: Dataset) -> None:
    result = fit(tiny_config(train={"epochs": 6}), tiny_dataset, CPU)
    assert len(result.history) == 6
    first, last = result.history[0], result.history[-1]
    assert last["val_loss"] < first["val_loss"]
    assert max(r["val_accuracy"] for r in result.history) > 0.85
    for key in ("train_loss", "samples_per_s", "epoch_seconds", "peak_memory_mb", "grad_norm_mean"):
        assert math.isfinite(last[key]) and last[key] > 0, key
    assert last["nonfinite_steps"] == 0
    assert last["lr"] < first["lr"]  # cosine decay


def test_a_linear_model_without_hidden_layers_trains(tiny_dataset: Dataset) -> None:
    result = fit(tiny_config(model={"hidden_sizes": []}, train={"epochs": 6}), tiny_dataset, CPU)
    assert [type(m).__name__ for m in result.model] == ["Linear"]
    assert result.history[-1]["val_loss"] < result.history[0]["val_loss"]
    assert max(r["val_accuracy"] for r in result.history) > 0.8


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "sgd"])
def test_every_optimizer_trains(tiny_dataset: Dataset, optimizer: str) -> None:
    cfg = tiny_config(train={"optimizer": optimizer, "lr": 0.05 if optimizer == "sgd" else 0.01, "epochs": 5})
    history = fit(cfg, tiny_dataset, CPU).history
    assert history[-1]["val_loss"] < history[0]["val_loss"]


def test_same_seed_same_weights_other_seed_differs(tiny_dataset: Dataset) -> None:
    a = model_weights(fit(tiny_config(), tiny_dataset, CPU).model)
    b = model_weights(fit(tiny_config(), tiny_dataset, CPU).model)
    c = model_weights(fit(tiny_config(train={"seed": 1}), tiny_dataset, CPU).model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_cosine_schedule_warms_up_then_decays() -> None:
    cfg = tiny_config(train={"schedule": "cosine", "warmup_epochs": 1, "epochs": 4}).train
    opt = make_optimizer(cfg, [torch.nn.Parameter(torch.zeros(1))])
    sched = make_schedule(cfg, opt, steps_per_epoch=10)
    lrs = []
    for _ in range(40):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(cfg.lr / 10) and lrs[9] == pytest.approx(cfg.lr)
    assert lrs[10] > lrs[25] > lrs[39] >= 0


def test_early_stopping_restores_best_epoch(tiny_dataset: Dataset) -> None:
    # a huge lr makes val loss climb after the first epochs
    cfg = tiny_config(train={"epochs": 30, "lr": 0.5, "early_stopping_patience": 2, "schedule": "constant"})
    result = fit(cfg, tiny_dataset, CPU)
    assert result.stopped_early and len(result.history) < 30
    best = min(result.history, key=lambda r: r["val_loss"])
    assert result.best_epoch == int(best["epoch"])


def test_resume_after_interruption_ends_with_same_model(tiny_dataset: Dataset, tmp_path: Path) -> None:
    cfg = tiny_config(model={"dropout": 0.2}, train={"epochs": 5, "schedule": "cosine"})
    expected = fit(cfg, tiny_dataset, CPU)
    checkpoint = tmp_path / "ckpt.pt"
    with pytest.raises(KeyboardInterrupt):
        fit(cfg, tiny_dataset, CPU, tracker=StopAfter(2), checkpoint=checkpoint)  # type: ignore[arg-type]
    saved = torch.load(checkpoint, weights_only=True)  # plain tensors and values only
    assert saved["state"]["epoch"] == 2
    resumed = fit(cfg, tiny_dataset, CPU, checkpoint=checkpoint)
    assert [r["epoch"] for r in resumed.history] == [1, 2, 3, 4, 5]
    want, got = model_weights(expected.model), model_weights(resumed.model)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert resumed.history[-1]["val_loss"] == expected.history[-1]["val_loss"]


def test_checkpoint_does_not_store_its_temporary_file_name(tiny_dataset: Dataset, tmp_path: Path) -> None:
    # byte equality cannot be asked of a checkpoint (its history holds timings); the random
    # temporary name inside the zip was the part that differed for identical weights
    checkpoint = tmp_path / "ckpt.pt"
    with pytest.raises(KeyboardInterrupt):
        fit(tiny_config(), tiny_dataset, CPU, tracker=StopAfter(1), checkpoint=checkpoint)  # type: ignore[arg-type]
    with zipfile.ZipFile(checkpoint) as archive:
        assert {name.split("/")[0] for name in archive.namelist()} == {"archive"}


def _damage(checkpoint: Path, how: str) -> None:
    if how == "wrong contents":  # loads, but only part of it fits: the model would be half-restored
        saved = torch.load(checkpoint, weights_only=True)
        save_torch(checkpoint, {**saved, "optimizer": {"not": "an optimizer"}})
        return
    if how == "not a dict":
        save_torch(checkpoint, [1, 2, 3])
        return
    whole = checkpoint.read_bytes()
    checkpoint.write_bytes({"garbage": b"not a checkpoint", "empty": b"", "truncated": whole[: len(whole) // 2]}[how])


@pytest.mark.parametrize("how", ["garbage", "empty", "truncated", "wrong contents", "not a dict"])
def test_damaged_checkpoint_is_set_aside_and_training_starts_fresh(
    tiny_dataset: Dataset, tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    cfg = tiny_config(model={"dropout": 0.2})
    expected = fit(cfg, tiny_dataset, CPU)
    checkpoint = tmp_path / "ckpt.pt"
    with pytest.raises(KeyboardInterrupt):
        fit(cfg, tiny_dataset, CPU, tracker=StopAfter(2), checkpoint=checkpoint)  # type: ignore[arg-type]
    _damage(checkpoint, how)
    damaged = checkpoint.read_bytes()
    result = fit(cfg, tiny_dataset, CPU, checkpoint=checkpoint)
    assert [r["epoch"] for r in result.history] == [1, 2, 3, 4]
    want, got = model_weights(expected.model), model_weights(result.model)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert (tmp_path / "ckpt.pt.damaged").read_bytes() == damaged  # kept for a look, out of the way
    assert f"checkpoint {checkpoint} is damaged" in caplog.text
    assert torch.load(checkpoint, weights_only=True)["state"]["epoch"] == 4  # a good one again


def test_checkpoint_of_other_params_is_ignored(tiny_dataset: Dataset, tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt.pt"
    with pytest.raises(KeyboardInterrupt):
        fit(tiny_config(), tiny_dataset, CPU, tracker=StopAfter(2), checkpoint=checkpoint)  # type: ignore[arg-type]
    result = fit(tiny_config(train={"lr": 0.02}), tiny_dataset, CPU, checkpoint=checkpoint)
    fresh = fit(tiny_config(train={"lr": 0.02}), tiny_dataset, CPU)
    # a wrong resume would keep the lr=0.01 run's first two epochs and end with other weights
    assert [r["val_loss"] for r in result.history] == [r["val_loss"] for r in fresh.history]
    want, got = model_weights(fresh.model), model_weights(result.model)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_batch_larger_than_train_split_is_rejected(tiny_dataset: Dataset) -> None:
    with pytest.raises(ValueError, match=r"train.batch_size \(1024\) is larger than the train split"):
        fit(tiny_config(train={"batch_size": 1024}), tiny_dataset, CPU)


def test_non_finite_gradients_stop_the_run_instead_of_training_on_nan(tiny_dataset: Dataset) -> None:
    cfg = tiny_config(train={"max_nonfinite_steps": 3})
    with pytest.raises(NonFiniteError, match="consecutive steps had non-finite gradients"):
        fit(cfg, _poisoned(tiny_dataset, "train"), CPU)


def _poisoned(dataset: Dataset, split: str) -> Dataset:
    """`dataset` with every feature of one split replaced by NaN."""
    bad = getattr(dataset, split)
    return replace(dataset, **{split: Split(np.full_like(bad.x, np.nan), bad.y)})


def test_non_finite_steps_are_counted_across_epochs(tiny_dataset: Dataset) -> None:
    # 13 steps per epoch, all non-finite: the limit of 20 is reached in epoch 2, not never
    cfg = tiny_config(train={"max_nonfinite_steps": 20})
    with pytest.raises(NonFiniteError, match=r"26 consecutive steps .* by epoch 2 .*the train inputs contain NaN"):
        fit(cfg, _poisoned(tiny_dataset, "train"), CPU)


def test_resumed_run_keeps_counting_non_finite_steps(
    tiny_dataset: Dataset, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, data = tiny_config(train={"max_nonfinite_steps": 20}), _poisoned(tiny_dataset, "train")
    checkpoint = tmp_path / "ckpt.pt"
    epoch_stats, calls = train.epoch_stats, []

    def interrupt_in_epoch_2(*args: object) -> object:
        calls.append(1)
        if len(calls) == 2:  # Ctrl-C in epoch 2, after epoch 1's checkpoint
            raise KeyboardInterrupt
        return epoch_stats(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(train, "epoch_stats", interrupt_in_epoch_2)
    with pytest.raises(KeyboardInterrupt):
        fit(cfg, data, CPU, checkpoint=checkpoint)
    monkeypatch.undo()
    with pytest.raises(NonFiniteError, match=r"26 consecutive steps .* by epoch 2 "):  # as uninterrupted
        fit(cfg, data, CPU, checkpoint=checkpoint)


def test_val_loss_never_finite_fails_and_blames_the_data(tiny_dataset: Dataset) -> None:
    with pytest.raises(NonFiniteError, match=r"validation loss was never finite .*the val inputs contain NaN"):
        fit(tiny_config(), _poisoned(tiny_dataset, "val"), CPU)


def test_val_loss_never_finite_from_divergence_says_lower_the_lr(tiny_dataset: Dataset) -> None:
    cfg = tiny_config(train={"optimizer": "sgd", "lr": 1e6, "schedule": "constant", "max_nonfinite_steps": 10_000})
    with pytest.raises(NonFiniteError, match=r"validation loss was never finite .*lower train.lr") as err:
        fit(cfg, tiny_dataset, CPU)
    assert "inputs contain" not in str(err.value)


def test_resume_from_the_stopping_epoch_stops_again(tiny_dataset: Dataset, tmp_path: Path) -> None:
    cfg = tiny_config(train={"epochs": 30, "lr": 0.5, "early_stopping_patience": 2, "schedule": "constant"})
    checkpoint = tmp_path / "ckpt.pt"
    first = fit(cfg, tiny_dataset, CPU, checkpoint=checkpoint)  # fit leaves its last checkpoint behind
    assert first.stopped_early
    again = fit(cfg, tiny_dataset, CPU, checkpoint=checkpoint)
    assert again.stopped_early and len(again.history) == len(first.history)
    want, got = model_weights(first.model), model_weights(again.model)
    assert all(torch.equal(want[k], got[k]) for k in want)
