"""Seeds of any module trained together through vmap (seeds/functional.py) give what separate runs
give within 1e-5 (fp32, CPU): the CNN, the transformer and usermodels/residual.py, dropout on;
models the path cannot take train apart, saying why."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchlab import data
from batchlab.config import Config
from batchlab.data import Dataset, Split, build
from batchlab.paths import Paths
from batchlab.seeds import vectorized
from batchlab.seeds.functional import record_draws
from batchlab.seeds.standins import Masks, draw_masks, stand_in
from batchlab.sweep import groups
from batchlab.sweep.plan import Experiment
from batchlab.training import gns_probes
from batchlab.training.strategy import Strategy
from batchlab.training.train import TrainResult, fit, initial_model
from tests.support import seeds_apart, tiny_config

TOL = 1e-5
MEASURED = {"samples_per_s", "epoch_seconds", "peak_memory_mb"}
CPU = torch.device("cpu")
HERE = "tests.seeds.test_vectorized_generic"

IMAGES = {"source": "digits_images"}
TOKENS = {"source": "sequences", "samples": 600, "classes": 3, "seq_len": 8}
MODELS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "cnn": (IMAGES, {"name": "cnn", "channels": [4, 8], "dropout": 0.2}),
    "transformer": (TOKENS, {"name": "transformer", "d_model": 16, "heads": 2, "layers": 2, "dropout": 0.2}),
    "residual": (IMAGES, {"factory": "usermodels.residual:build", "kwargs": {"width": 8}}),
    "residual+dropout": (IMAGES, {"factory": f"{HERE}:residual_with_dropout", "kwargs": {"width": 8}}),
}


def residual_with_dropout(input_shape: tuple[int, ...], n_classes: int, width: int = 8) -> nn.Module:
    """usermodels/residual.py with dropout before its head (its own has none)."""
    from usermodels.residual import build as residual

    model = residual(input_shape, n_classes, width=width)
    model.head = nn.Sequential(nn.Dropout(0.3), model.head)
    return model


def batchnorm_cnn(input_shape: tuple[int, ...], n_classes: int) -> nn.Module:
    channels, height, width = input_shape
    return nn.Sequential(nn.Conv2d(channels, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * height * width, n_classes))  # fmt: skip


class DropsInForward(nn.Module):
    """Dropout called as a function in forward: no module the stacked forward can stand in for."""

    def __init__(self, input_shape: tuple[int, ...], n_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(math.prod(input_shape), n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(F.dropout(x.flatten(1), 0.2, self.training))


def drops_in_forward(input_shape: tuple[int, ...], n_classes: int) -> nn.Module:
    return DropsInForward(input_shape, n_classes)


def _configs(kind: str, seeds: tuple[int, ...] = (0, 1), **train: Any) -> list[Config]:
    data, model = MODELS[kind]
    settings = {"epochs": 3, "gns": True, "eval_every_steps": 5, **train}
    return [tiny_config(data=data, model=model, train={**settings, "seed": seed}) for seed in seeds]


def _dataset(cfg: Config) -> Dataset:
    """The source's data cut to 256 train and 96 val rows: 8 steps an epoch at batch 32."""
    dataset = build(cfg.data)[0]
    return replace(dataset, train=_first(dataset.train, 256), val=_first(dataset.val, 96))


def _first(split: Split, rows: int) -> Split:
    return Split(split.x[:rows], split.y[:rows])


def _free_of_the_loss(name: str, weights: torch.Tensor) -> torch.Tensor:
    """The weights the loss depends on. An attention layer's key bias adds the same score to each
    key of a query, which softmax cancels: its gradient is 0 but for rounding noise, which Adam
    scales up to the lr (1e-3 here after 24 steps), the separate run's noise and vmap's differing.
    What it leaves of the function, nothing, the val logits check."""
    if name.endswith("self_attn.in_proj_bias"):
        query, _, value = weights.chunk(3)
        return torch.cat([query, value])
    return weights


def _assert_close(separate: TrainResult, together: TrainResult, x_val: torch.Tensor) -> None:
    """Weights, val logits, history and val curve within TOL (relative where a figure is larger than 1)."""
    for (name, a), (other, b) in zip(
        separate.model.state_dict().items(), together.model.state_dict().items(), strict=True
    ):
        assert name == other
        torch.testing.assert_close(_free_of_the_loss(name, b), _free_of_the_loss(name, a), atol=TOL, rtol=0, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(together.model(x_val), separate.model(x_val), atol=TOL, rtol=0)
    assert (together.best_epoch, together.stopped_early) == (separate.best_epoch, separate.stopped_early)
    for rows_a, rows_b in ((separate.history, together.history), (separate.val_curve, together.val_curve)):
        assert len(rows_b) == len(rows_a) > 0
        for a_row, b_row in zip(rows_a, rows_b, strict=True):
            assert a_row.keys() == b_row.keys()
            for key in a_row.keys() - MEASURED:
                a, b = a_row[key], b_row[key]
                assert (math.isnan(a) and math.isnan(b)) or abs(a - b) <= TOL * max(1.0, abs(a)), (key, a, b)


@pytest.fixture
def probe_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """The noise probe every 4th step: a tiny run has too few steps for its default period."""
    monkeypatch.setattr(gns_probes, "full_split_every", lambda rows, batch, passes: 4)


@pytest.mark.parametrize("kind", ["cnn", "transformer", "residual+dropout"])
def test_stand_in_masks_drawn_per_seed_are_the_masks_the_model_draws(kind: str) -> None:
    """A training-mode forward of the model after manual_seed(s) equals its stand-in's forward with
    masks drawn from a generator seeded s; both leave their generator in the same state."""
    cfg = _configs(kind, seeds=(0,))[0]
    dataset = _dataset(cfg)
    model = initial_model(cfg, dataset.input_shape, dataset.n_classes, dataset.vocab).train()
    x = torch.from_numpy(dataset.train.x[:16])
    torch.manual_seed(123)
    expected = model(x)
    masks = Masks()
    base = stand_in(model, masks)
    state = (dict(model.named_parameters()), dict(model.named_buffers()))
    draws = record_draws(base, masks, state, x)
    assert len(draws) == {"cnn": 1, "transformer": 8, "residual+dropout": 1}[kind]  # 4 per encoder layer
    generator = torch.Generator().manual_seed(123)
    (drawn,) = zip(*draw_masks(draws, [generator], CPU), strict=True)  # the one seed's masks
    with masks.feeding(list(drawn)):
        got = torch.func.functional_call(base, state, (x,))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(generator.get_state(), torch.get_rng_state())
    assert any((mask == 0).any() for mask in drawn)  # dropout dropped something


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_seeds_of_any_module_together_equal_separate_fits(kind: str, probe_often: None) -> None:
    cfgs = _configs(kind)
    dataset = _dataset(cfgs[0])
    assert vectorized.model_trains_apart(cfgs[0], dataset, Strategy(CPU)) is None  # the vmap path runs
    separate = [fit(cfg, dataset, Strategy(CPU)) for cfg in cfgs]
    together = vectorized.fit_seeds(cfgs, dataset, Strategy(CPU))
    x_val = torch.from_numpy(dataset.val.x)
    for a, b in zip(separate, together, strict=True):
        _assert_close(a, b, x_val)
    # the comparison means something: the noise scale was measured and the seeds differ
    assert sum(math.isfinite(r["gns.b_simple"]) for r in together[0].history) >= 2
    first, second = (dict(r.model.named_parameters()) for r in together[:2])
    name = next(iter(first))
    assert (first[name] - second[name]).abs().max() > 0.01


def test_interrupted_cnn_group_resumes_in_either_path_to_the_uninterrupted_result(
    tmp_path: Path, probe_often: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfgs = _configs("cnn", seeds=(0, 1, 2))
    dataset = _dataset(cfgs[0])
    checkpoints: list[Path | None] = [tmp_path / f"seed{c.train.seed}.pt" for c in cfgs]
    finish_epoch, calls = vectorized._finish_epoch, []

    def interrupt_in_epoch_2(*args: Any) -> None:
        calls.append(1)
        if len(calls) == len(cfgs) + 1:  # Ctrl-C in epoch 2, after epoch 1's checkpoints
            raise KeyboardInterrupt
        finish_epoch(*args)

    monkeypatch.setattr(vectorized, "_finish_epoch", interrupt_in_epoch_2)
    with pytest.raises(KeyboardInterrupt):
        vectorized.fit_seeds(cfgs, dataset, Strategy(CPU), checkpoints=checkpoints)
    monkeypatch.setattr(vectorized, "_finish_epoch", finish_epoch)
    assert vectorized.epochs_to_resume(cfgs, dataset, [p for p in checkpoints if p]) == [1, 1, 1]
    # seed 0 resumes alone in fit (the checkpoint is fit's format), seeds 1 and 2 together
    resumed = [fit(cfgs[0], dataset, Strategy(CPU), checkpoint=checkpoints[0])]
    resumed += vectorized.fit_seeds(cfgs[1:], dataset, Strategy(CPU), checkpoints=checkpoints[1:])
    for cfg, result in zip(cfgs, resumed, strict=True):
        _assert_close(fit(cfg, dataset, Strategy(CPU)), result, torch.from_numpy(dataset.val.x))


@pytest.mark.parametrize(
    ("factory", "reason"),
    [
        ("batchnorm_cnn", "batch statistics for a model with BatchNorm2d (a row's gradient depends on its batch's "
                          "statistics): its running statistics change in train mode"),
        ("drops_in_forward", "its forward draws random numbers besides nn.Dropout and nn.MultiheadAttention's "
                             "dropout"),
    ],
)  # fmt: skip
def test_a_model_the_vmap_path_cannot_take_trains_its_seeds_apart_saying_why(
    factory: str, reason: str, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    model = {"factory": f"{HERE}:{factory}"}
    cfgs = [tiny_config(data=IMAGES, model=model, train={"epochs": 2, "seed": seed}) for seed in (0, 1)]
    dataset = _dataset(cfgs[0])
    # the config cannot tell: the sweep tries the model on the prepared rows, and does not group
    # its seeds (each then fills a lane and keeps its own wall time), saying why once
    paths = Paths(tmp_path)
    data.save(dataset, build(cfgs[0].data)[1], paths.data)
    todo = [Experiment(b, s, 0.01, 2) for b in (16, 32) for s in (0, 1)]
    sweep_cfg = tiny_config(data=IMAGES, model=model, sweep={"seeds": [0, 1]})
    with caplog.at_level(logging.INFO, logger="batchlab.sweep.groups"):
        assert [len(g) for g in groups.groups(sweep_cfg, todo, seeds_apart(sweep_cfg, paths))] == [1, 1, 1, 1]
    said = [r.getMessage() for r in caplog.records if r.name == "batchlab.sweep.groups"]
    assert len(said) == 1, said
    assert said[0].startswith(f"sweep: seeds train one after another: model.factory {HERE}:{factory}: {reason}")
    # fit_seeds, given such seeds all the same, finds the reason itself and fits each as fit does
    with caplog.at_level(logging.INFO, logger="batchlab.seeds.vectorized"):
        together = vectorized.fit_seeds(cfgs, dataset, Strategy(CPU))
    said = [r.getMessage() for r in caplog.records if r.name == "batchlab.seeds.vectorized"]
    assert len(said) == 1, said
    assert said[0].startswith(f"seeds 0, 1 train one after another: model.factory {HERE}:{factory}: {reason}"), said
    for cfg, result in zip(cfgs, together, strict=True):  # each is its separate run: the same code ran
        separate = fit(cfg, dataset, Strategy(CPU))
        for a, b in zip(separate.model.state_dict().values(), result.model.state_dict().values(), strict=True):
            assert torch.equal(a, b)
        assert [r["val_loss"] for r in result.history] == [r["val_loss"] for r in separate.history]
