"""Seeds trained together in one vectorized model give what separate runs give (fp32, CPU)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from batchlab import atomic, stages
from batchlab.config import Config
from batchlab.data import Dataset, Split
from batchlab.model import ACTIVATIONS
from batchlab.paths import Paths
from batchlab.seeds import vectorized
from batchlab.sweep import groups, speeds
from batchlab.sweep.plan import Experiment, experiment_config, plan
from batchlab.sweep.run import run_sweep
from batchlab.training import gns_probes
from batchlab.training.strategy import Strategy
from batchlab.training.support import seeds_train_apart
from batchlab.training.throughput import Table
from batchlab.training.train import TrainResult, fit
from tests.support import seeds_apart, tiny_config

TOL = 1e-6
# timings and the process's memory are measured, not computed: they differ between any two runs
MEASURED = {"samples_per_s", "epoch_seconds", "peak_memory_mb"}
CPU = torch.device("cpu")


def _configs(seeds: tuple[int, ...] = (0, 1, 2), activation: str = "relu", **train: Any) -> list[Config]:
    # dropout in both hidden layers, the noise scale on, the val split scored within epochs
    model = {"hidden_sizes": [16, 16], "dropout": 0.2, "activation": activation}
    return [
        tiny_config(model=model, train={"gns": True, "eval_every_steps": 5, **train, "seed": seed}) for seed in seeds
    ]


def _assert_same(separate: TrainResult, together: TrainResult) -> None:
    for (name, a), (other, b) in zip(
        separate.model.state_dict().items(), together.model.state_dict().items(), strict=True
    ):
        assert name == other
        torch.testing.assert_close(b, a, atol=TOL, rtol=0, msg=name)
    assert (together.best_epoch, together.stopped_early) == (separate.best_epoch, separate.stopped_early)
    for rows_a, rows_b in ((separate.history, together.history), (separate.val_curve, together.val_curve)):
        assert len(rows_b) == len(rows_a)
        for a_row, b_row in zip(rows_a, rows_b, strict=True):
            assert a_row.keys() == b_row.keys()
            for key in a_row.keys() - MEASURED:
                a, b = a_row[key], b_row[key]
                assert (math.isnan(a) and math.isnan(b)) or abs(a - b) <= TOL * max(1.0, abs(a)), (key, a, b)


@pytest.fixture
def probe_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """The noise probe every 4th step: a tiny run has too few steps for its default period."""
    monkeypatch.setattr(gns_probes, "full_split_every", lambda rows, batch, passes: 4)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_three_seeds_together_equal_three_separate_fits(
    tiny_dataset: Dataset, probe_often: None, activation: str
) -> None:
    """stacked.py writes the backward out for every activation the model offers: each as autograd's."""
    cfgs = _configs(activation=activation)
    separate = [fit(cfg, tiny_dataset, Strategy(CPU)) for cfg in cfgs]
    together = vectorized.fit_seeds(cfgs, tiny_dataset, Strategy(CPU))
    for a, b in zip(separate, together, strict=True):
        _assert_same(a, b)
    # the comparison means something: the noise scale was measured, dropout on, and seeds differ
    assert all(math.isfinite(r["gns.b_simple"]) for r in together[0].history[1:])
    assert sum(math.isfinite(p["gns.b_simple"]) for p in together[0].val_curve) > 5
    first, second = (r.model.state_dict()["0.weight"] for r in together[:2])
    assert (first - second).abs().max() > 0.01


def test_early_stopping_stops_each_seed_at_its_own_epoch(tiny_dataset: Dataset) -> None:
    cfgs = _configs(epochs=12, lr=0.05, early_stopping_patience=1, gns=False)
    separate = [fit(cfg, tiny_dataset, Strategy(CPU)) for cfg in cfgs]
    assert len({len(r.history) for r in separate}) > 1  # the seeds stop at different epochs
    for a, b in zip(separate, vectorized.fit_seeds(cfgs, tiny_dataset, Strategy(CPU)), strict=True):
        _assert_same(a, b)


def test_a_step_one_seed_skips_leaves_the_others_stepping(tiny_dataset: Dataset, probe_often: None) -> None:
    x = tiny_dataset.train.x.copy()
    x[7] = np.nan  # one row: each seed meets it at its own step of every epoch, and skips that step
    dataset = replace(tiny_dataset, train=Split(x, tiny_dataset.train.y))
    cfgs = _configs()
    separate = [fit(cfg, dataset, Strategy(CPU)) for cfg in cfgs]
    assert all(row["nonfinite_steps"] == 1 for r in separate for row in r.history)
    for a, b in zip(separate, vectorized.fit_seeds(cfgs, dataset, Strategy(CPU)), strict=True):
        _assert_same(a, b)


def test_interrupted_group_resumes_in_either_path_to_the_uninterrupted_result(
    tiny_dataset: Dataset, tmp_path: Path, probe_often: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfgs = _configs()
    checkpoints: list[Path | None] = [tmp_path / f"seed{c.train.seed}.pt" for c in cfgs]
    finish_epoch, calls = vectorized._finish_epoch, []

    def interrupt_in_epoch_2(*args: Any) -> None:
        calls.append(1)
        if len(calls) == len(cfgs) + 1:  # Ctrl-C in epoch 2, after epoch 1's checkpoints
            raise KeyboardInterrupt
        finish_epoch(*args)

    monkeypatch.setattr(vectorized, "_finish_epoch", interrupt_in_epoch_2)
    with pytest.raises(KeyboardInterrupt):
        vectorized.fit_seeds(cfgs, tiny_dataset, Strategy(CPU), checkpoints=checkpoints)
    monkeypatch.setattr(vectorized, "_finish_epoch", finish_epoch)
    assert vectorized.epochs_to_resume(cfgs, tiny_dataset, [p for p in checkpoints if p]) == [1, 1, 1]
    # seed 0 resumes alone in fit (the checkpoint is fit's format), seeds 1 and 2 together
    resumed = [fit(cfgs[0], tiny_dataset, Strategy(CPU), checkpoint=checkpoints[0])]
    resumed += vectorized.fit_seeds(cfgs[1:], tiny_dataset, Strategy(CPU), checkpoints=checkpoints[1:])
    for cfg, result in zip(cfgs, resumed, strict=True):
        _assert_same(fit(cfg, tiny_dataset, Strategy(CPU)), result)


def _sweep(folder: Path, vectorize: bool) -> list[dict[str, Any]]:
    cfg = tiny_config(sweep={"batch_sizes": [16, 64], "seeds": [0, 1], "vectorize_seeds": vectorize})
    stages.generate(cfg, Paths(folder))
    run_sweep(cfg, Paths(folder))
    return [json.loads(p.read_text()) for p in sorted((folder / "sweep/experiments").glob("*/result.json"))]


@pytest.mark.integration
def test_sweep_with_seeds_together_gives_the_sequential_result_rows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sequential = _sweep(tmp_path / "apart", False)
    with caplog.at_level(logging.INFO, logger="batchlab.sweep.groups"):
        together = _sweep(tmp_path / "together", True)
    said = {r.getMessage() for r in caplog.records if r.name == "batchlab.sweep.groups"}
    assert said == {f"sweep: bs{b}-seed0, bs{b}-seed1 train together" for b in (16, 64)}
    assert [r["name"] for r in together] == [r["name"] for r in sequential] and len(together) == 4
    for a, b in zip(sequential, together, strict=True):
        assert b["curve_steps"] == a["curve_steps"]
        for key in ("test_f1_macro", "test_accuracy", "grad_norm_mean", "gns_b_simple", "step_memory_mib"):
            assert b[key] == pytest.approx(a[key], abs=TOL, nan_ok=True), key
        for key in ("curve_val_loss", "curve_b_simple"):
            assert b[key] == pytest.approx(a[key], abs=TOL, nan_ok=True), key
        reports = {
            name: tmp_path / name / "sweep/experiments" / a["name"] / "reports" for name in ("apart", "together")
        }
        assert (reports["together"] / "train.json").is_file() and (reports["together"] / "history.csv").is_file()
        assert not (reports["together"].parent / ".batchlab/checkpoints/train.pt").exists()
    # the group's wall time is shared, not counted once per seed; the speed compared across batch
    # sizes is the sweep's throughput table's, timed side by side, and each experiment's seconds are
    # its examples at that speed (the study's own probes are not the batch size's cost)
    assert sum(r["train_seconds"] for r in together) > 0
    table = Table.from_dict(json.loads((tmp_path / "together" / "sweep" / speeds.TABLE).read_text()))
    assert [e.batch_size for e in table.entries] == [16, 64] and table.probe is not None
    for row in together:
        per_s = table.samples_per_s(row["batch_size"])
        assert row["clock"] == "table" and row["samples_per_s"] == per_s
        history = atomic.read_csv(tmp_path / "together/sweep/experiments" / row["name"] / "reports/history.csv")
        assert float(history[-1]["gns.probes"]) == row["epochs"] - 1  # once an epoch, after the first
        expected = [examples / per_s for examples in row["epoch_examples"]]
        assert row["epoch_train_seconds"] == pytest.approx(expected, rel=1e-12)


def test_seeds_train_apart_where_the_vectorized_path_does_not_apply(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    todo = [Experiment(b, s, 0.01, 3) for b in (16, 32) for s in (0, 1)]
    paths = Paths(tmp_path)  # the MLP's seeds group on the config alone: no data read
    mlp = tiny_config(sweep={"seeds": [0, 1]})
    assert [len(g) for g in groups.groups(mlp, todo, seeds_apart(mlp, paths))] == [2, 2]
    off = tiny_config(sweep={"seeds": [0, 1], "vectorize_seeds": False})
    assert [len(g) for g in groups.groups(off, todo, seeds_apart(off, paths))] == [1, 1, 1, 1]
    ddp = tiny_config(train={"strategy": "ddp", "nproc": 2}, sweep={"seeds": [0, 1]})
    with caplog.at_level(logging.INFO, logger="batchlab.sweep.groups"):
        assert [len(g) for g in groups.groups(ddp, todo, seeds_apart(ddp, paths))] == [1, 1, 1, 1]
    said = [r.getMessage() for r in caplog.records if r.name == "batchlab.sweep.groups"]
    assert len(said) == 1 and "seeds train one after another: train.strategy ddp with 2 ranks" in said[0]
    with pytest.raises(ValueError, match="fp16"):
        vectorized.fit_seeds(_configs(precision="fp16"), Dataset.__new__(Dataset), Strategy(CPU))


def test_the_fixed_rows_seeds_train_together_when_params_ask_batchlab_train_for_an_adaptive_batch(
    tmp_path: Path,
) -> None:
    """train.adaptive_batch in params is `batchlab train`'s: the sweep's fixed rows train at a fixed
    batch (plan.experiment_config), so their seeds group; only sweep.adaptive's rows train alone.
    Before, the sweep's own config was asked, and every fixed row trained its seeds one by one."""
    cfg = tiny_config(train={"adaptive_batch": True, "batch_size": 16}, sweep={"seeds": [0, 1], "adaptive": True})
    todo = plan(cfg, n_train=420)
    work = groups.groups(cfg, todo, seeds_apart(cfg, Paths(tmp_path)))
    fixed = [w for w in work if not any(e.adaptive for e in w.experiments)]
    assert fixed and all(len(w) == 2 for w in fixed)
    assert sorted(len(w) for w in work if w not in fixed) == [1, 1]  # each adaptive seed alone
    assert all(seeds_train_apart(experiment_config(cfg, e)) is None for w in fixed for e in w.experiments)


def test_configs_that_differ_in_more_than_the_seed_are_refused(tiny_dataset: Dataset) -> None:
    cfgs = [*_configs(seeds=(0,)), *_configs(seeds=(1,), lr=0.02)]
    with pytest.raises(ValueError, match=r"differ in train\.seed only"):
        vectorized.fit_seeds(cfgs, tiny_dataset, Strategy(CPU))


@pytest.mark.parametrize(("pick", "chunk"), [(False, None), (True, None), (False, 7)])
def test_the_groups_probe_in_one_stacked_pass_reads_each_seeds_separate_probe(
    tiny_dataset: Dataset, monkeypatch: pytest.MonkeyPatch, pick: bool, chunk: int | None
) -> None:
    """StackedModels.probe_together against each seed's own FullSplitProbe.measure at the same
    weights and step: the passes in slices of two sizes, the rows drawn from a larger split
    (`pick`), each seed's masks from its own generator; the training's generators and gradients
    untouched. Bit for bit at the probe's own chunking (slices of 52-53 rows here, 350 in the
    default study); in chunks of 7 rows, where bmm and mm take kernels of their own, within 1e-6."""
    from batchlab.seeds.stacked import StackedModels
    from batchlab.tracking import Tracker
    from batchlab.training.optim import steps_per_epoch
    from batchlab.training.train import split_tensors

    monkeypatch.setattr(gns_probes, "ROW_SAMPLE", 23)
    if chunk is not None:
        monkeypatch.setattr(gns_probes, "FULL_SPLIT_CHUNK", chunk)  # several chunks a slice
    if pick:
        monkeypatch.setattr(gns_probes, "FULL_SPLIT_ROWS", 300)
    cfgs = _configs()
    n_train = tiny_dataset.train.y.shape[0]
    assert n_train % gns_probes.PARTS and n_train > 300  # slices of two sizes
    steps = steps_per_epoch(n_train, cfgs[0].train.batch_size)
    seeds = vectorized.restore(cfgs, tiny_dataset, Strategy(CPU), steps, [Tracker() for _ in cfgs], None)
    for seed in seeds:
        seed.dropout.manual_seed(100 + seed.index)
    group = StackedModels(seeds, Strategy(CPU), split_tensors(tiny_dataset.train, CPU))
    with torch.no_grad():  # weights apart from the initial ones: a gradient that is not tiny
        for w in group.weights.values():
            w.add_(torch.randn_like(w) * 0.1)
    grads, states = group.flat_grads.clone(), [s.dropout.get_state() for s in seeds]
    together = group.probe_together(seeds, step=37)
    assert torch.equal(group.flat_grads, grads)
    assert all(torch.equal(s.dropout.get_state(), state) for s, state in zip(seeds, states, strict=True))
    for seed, measured in zip(seeds, together, strict=True):
        assert seed.probe is not None
        alone = seed.probe.measure(37)
        assert measured.rows == alone.rows == (300 if pick else n_train)
        for field in ("cross", "half_diff_sq", "row_sq", "row_sq_var", "cross_var"):
            a, b = getattr(alone, field), getattr(measured, field)
            if chunk is None:
                assert torch.equal(b, a), field
            else:
                torch.testing.assert_close(b, a, rtol=1e-6, atol=0, msg=field)
        assert float(alone.half_diff_sq) > 0 and float(alone.row_sq) > float(alone.cross) > 0  # masks, rows' noise
    assert float(together[0].cross) != float(together[1].cross)  # the seeds' own weights and masks
