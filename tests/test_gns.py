"""The gradient noise scale (gns.py, measured through strategy.py) and the step-granular val curve."""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from batchlab import stages
from batchlab.config import Config, load_config
from batchlab.data import Dataset
from batchlab.data import load as load_data
from batchlab.training import gns, gns_probes
from batchlab.training.gns import NoiseScale
from batchlab.training.strategy import Strategy
from batchlab.training.train import TrainResult, fit
from tests.conftest import run, set_params, tiny_config
from tests.test_train import StopAfter

GNS_KEYS = {"gns.b_simple", "gns.grad_sq", "gns.trace_sigma"}


def _fit(cfg: Config, dataset: Dataset, checkpoint: Path | None = None) -> TrainResult:
    strategy = Strategy(torch.device("cpu"), grad_accum_steps=cfg.train.grad_accum_steps)
    return fit(cfg, dataset, strategy, checkpoint=checkpoint)


def _final(result: TrainResult) -> dict[str, float]:
    return {k: result.history[-1][k] for k in GNS_KEYS}


def _assert_finite_positive(values: dict[str, float]) -> None:
    for key, value in values.items():
        assert math.isfinite(value) and value > 0, (key, value)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread, as train.threads gives a real run: two threads spin against a busy
    neighbour on a 2-core machine and made these tests ~50x slower under load."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-example gradients at every step: a tiny run has too few steps for the default period."""
    monkeypatch.setattr(gns_probes, "PER_EXAMPLE_EVERY", 1)


@pytest.mark.parametrize("b_small, b_big", [(1, 32), (8, 32), (16, 32)])
def test_estimators_recover_a_known_noise_scale(b_small: int, b_big: int) -> None:
    # per-example gradients g_i = G + e_i, e_i ~ N(0, Σ) with Σ diagonal: B_simple = tr(Σ)/|G|² exactly
    gen = torch.Generator().manual_seed(0)
    dims = 50
    true_grad = torch.randn(dims, generator=gen, dtype=torch.float64) * 0.1
    sigma_diag = torch.rand(dims, generator=gen, dtype=torch.float64) * 0.2
    expected = sigma_diag.sum().item() / true_grad.square().sum().item()

    def mean_gradient(rows: int) -> torch.Tensor:  # the mean of `rows` per-example gradients
        return true_grad + torch.randn(dims, generator=gen, dtype=torch.float64) * (sigma_diag / rows).sqrt()

    noise = NoiseScale(decay=0.998)  # a long memory: the test asks for the value, not a tracking lag
    for _ in range(4000):
        # the small batch is part of the big one, as a micro-batch or a rank's rows are
        small, rest = mean_gradient(b_small), mean_gradient(b_big - b_small)
        big = (b_small * small + (b_big - b_small) * rest) / b_big
        noise.record_step(big.norm(), (small.square().sum(), b_small), b_big)
    noise.settle()
    assert expected == pytest.approx(noise.b_simple, rel=0.10)
    assert noise.trace_sigma == pytest.approx(sigma_diag.sum().item(), rel=0.10)


def test_estimators_recover_the_noise_scale_of_a_finite_train_set() -> None:
    # batches drawn without replacement from 200 rows: the batch mean's variance shrinks by
    # (N-B)/(N-1), which the plain formulas would read as a |G|² smaller by tr(Σ)/(N-1)
    gen = torch.Generator().manual_seed(1)
    rows, dims, b_big = 200, 20, 64
    per_example = torch.randn(rows, dims, generator=gen, dtype=torch.float64) + 0.08
    true_grad = per_example.mean(0)
    trace = (per_example - true_grad).square().sum(1).mean().item()
    expected = trace / true_grad.square().sum().item()
    assert expected > rows / 3  # where it matters: uncorrected, B_simple reads 1/(1 - B/N) = ~2x high
    noise = NoiseScale(population=rows, decay=0.999)
    for _ in range(8000):
        batch = per_example[torch.randperm(rows, generator=gen)[:b_big]]
        noise.record_step(batch.mean(0).norm(), (batch.square().sum(1).mean(), 1), b_big)
    noise.settle()
    assert noise.b_simple == pytest.approx(expected, rel=0.10)
    assert noise.trace_sigma == pytest.approx(trace, rel=0.05)


def _exact_noise_scale(model: torch.nn.Module, dataset: Dataset) -> dict[str, float]:
    """tr(Σ)/|G|² from every train row's own gradient, at the model's weights."""
    x, y = torch.from_numpy(dataset.train.x), torch.from_numpy(dataset.train.y)
    grads = []
    for i in range(len(y)):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).double())
    per_example = torch.stack(grads)
    mean = per_example.mean(0)
    trace = (per_example - mean).square().sum(1).mean().item()
    return {"gns.grad_sq": mean.square().sum().item(), "gns.trace_sigma": trace,
            "gns.b_simple": trace / mean.square().sum().item()}  # fmt: skip


@pytest.mark.parametrize("accum", [1, 4])
def test_probes_recover_the_exact_noise_scale_of_a_still_model(
    tiny_dataset: Dataset, monkeypatch: pytest.MonkeyPatch, accum: int
) -> None:
    # lr 1e-9: the weights (so the true noise scale) stay put while the probe measures them, and
    # a long EMA averages its noise away. accum 1: per-example gradients; 4: micro-batches of 8
    monkeypatch.setattr(gns_probes, "PER_EXAMPLE_EVERY", 1)
    monkeypatch.setattr(gns_probes, "MICRO_BATCH_EVERY", 1)
    monkeypatch.setattr(gns, "DECAY", 0.995)
    cfg = tiny_config(train={"epochs": 12, "lr": 1e-9, "schedule": "constant", "grad_accum_steps": accum})
    result = _fit(cfg, tiny_dataset)
    exact = _exact_noise_scale(result.model, tiny_dataset)
    assert _final(result) == pytest.approx(exact, rel=0.15)


def test_per_example_path_logs_finite_positive_noise_scale(tiny_dataset: Dataset, every_step: None) -> None:
    result = _fit(tiny_config(train={"epochs": 3}), tiny_dataset)
    assert all(set(row) >= GNS_KEYS for row in result.history)
    _assert_finite_positive(_final(result))
    assert _final(result)["gns.b_simple"] == pytest.approx(
        _final(result)["gns.trace_sigma"] / _final(result)["gns.grad_sq"]
    )


def test_default_period_measures_a_longer_run(tiny_dataset: Dataset) -> None:
    # 13 steps an epoch: the default period (100) has measured twice by epoch 16
    _assert_finite_positive(_final(_fit(tiny_config(train={"epochs": 16}), tiny_dataset)))


def test_gns_changes_no_weight_and_off_logs_no_gns_keys(tiny_dataset: Dataset, every_step: None) -> None:
    # dropout draws from the global RNG in every step: per-example gradients must not move it
    on = _fit(tiny_config(model={"dropout": 0.3}, train={"gns": True}), tiny_dataset)
    off = _fit(tiny_config(model={"dropout": 0.3}, train={"gns": False}), tiny_dataset)
    a, b = on.model.state_dict(), off.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not any(key.startswith("gns.") for row in off.history for key in row)
    _assert_finite_positive(_final(on))


def test_grad_accumulation_path_gives_finite_positive_noise_scale(tiny_dataset: Dataset) -> None:
    result = _fit(tiny_config(train={"grad_accum_steps": 4, "epochs": 3}), tiny_dataset)
    _assert_finite_positive(_final(result))


def test_fp16_noise_scale_is_measured_after_unscaling(tiny_dataset: Dataset) -> None:
    # the loss scale (65536) squared would inflate both norms by ~4e9 if not divided out
    fp32 = _final(_fit(tiny_config(train={"grad_accum_steps": 2, "epochs": 3}), tiny_dataset))
    strategy = Strategy(torch.device("cpu"), precision="fp16", grad_accum_steps=2)
    cfg = tiny_config(train={"grad_accum_steps": 2, "epochs": 3, "precision": "fp16"})
    fp16 = _final(fit(cfg, tiny_dataset, strategy))
    for key in GNS_KEYS:
        assert fp16[key] == pytest.approx(fp32[key], rel=0.5), key


def _curve_steps(result: TrainResult) -> list[int]:
    return [int(point["step"]) for point in result.val_curve]


def test_val_curve_has_a_point_every_k_steps_and_a_resume_continues_it(
    tiny_dataset: Dataset, tmp_path: Path, every_step: None
) -> None:
    cfg = tiny_config(model={"dropout": 0.2}, train={"epochs": 5, "eval_every_steps": 5})
    expected = _fit(cfg, tiny_dataset)
    steps = 5 * (tiny_dataset.train.y.shape[0] // 32)
    assert _curve_steps(expected) == list(range(5, steps + 1, 5))  # across epoch boundaries
    assert all(p["examples"] == p["step"] * 32 for p in expected.val_curve)
    assert expected.val_curve[-1]["val_loss"] < expected.val_curve[0]["val_loss"]
    assert math.isfinite(expected.val_curve[-1]["gns.b_simple"])
    checkpoint = tmp_path / "ckpt.pt"
    with pytest.raises(KeyboardInterrupt):
        fit(cfg, tiny_dataset, Strategy(torch.device("cpu")), tracker=StopAfter(2), checkpoint=checkpoint)  # type: ignore[arg-type]
    saved = torch.load(checkpoint, weights_only=True)  # the curve and the EMAs are plain values
    assert len(saved["state"]["val_curve"]) == len([s for s in _curve_steps(expected) if s <= 2 * steps / 5])
    resumed = _fit(cfg, tiny_dataset, checkpoint)
    assert _curve_steps(resumed) == _curve_steps(expected)
    # the noise scale's EMAs continue from the checkpoint: the same figures as the unbroken run
    for want, got in zip(expected.val_curve, resumed.val_curve, strict=True):
        assert got["val_loss"] == want["val_loss"]
        assert got["gns.b_simple"] == pytest.approx(want["gns.b_simple"], nan_ok=True)
    assert _final(resumed) == pytest.approx(_final(expected))


def test_val_curve_b_simple_is_nan_when_gns_is_off(tiny_dataset: Dataset) -> None:
    result = _fit(tiny_config(train={"gns": False, "eval_every_steps": 13}), tiny_dataset)
    assert _curve_steps(result) == [13, 26, 39, 52]
    assert all(math.isnan(p["gns.b_simple"]) for p in result.val_curve)


def test_train_stage_writes_val_curve_csv_and_logs_undefined_noise_scale_to_mlflow(workdir: Path) -> None:
    # 4 epochs of 13 steps, fewer than the default period: gns.b_simple is NaN in every epoch row
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    cfg = tiny_config(train={"eval_every_steps": 10}, tracking={"enabled": True, "tracking_uri": uri})
    paths = stages.Paths(workdir)
    stages.generate(cfg, paths)
    info = stages.train(cfg, paths)
    with (workdir / "reports/val_curve.csv").open() as f:
        curve = list(csv.DictReader(f))
    assert [int(float(p["step"])) for p in curve] == [10, 20, 30, 40, 50]
    assert set(curve[0]) == {"step", "examples", "val_loss", "gns.b_simple"}
    with (workdir / "reports/history.csv").open() as f:
        assert set(next(csv.DictReader(f))) >= GNS_KEYS
    logged = MlflowClient(uri).get_metric_history(info["run_id"], "gns.b_simple")
    assert [m.step for m in logged] == [1, 2, 3, 4] and math.isnan(logged[0].value)
    # a later run without the curve leaves no stale file
    stages.train(tiny_config(tracking={"enabled": True, "tracking_uri": uri}), paths)
    assert not (workdir / "reports/val_curve.csv").exists()


@pytest.mark.slow
def test_ddp_noise_scale_agrees_with_single_process(repo_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the same data and seed: DDP's weights match one process's, so both measure the same training.
    # DDP pairs 16 rows with 32 (noisy, every step); one process pairs 1 row with 32 (every step
    # here). A factor of 2 is several standard errors of either EMA, and far below what a missing
    # world-size or scale factor would give.
    set_params(repo_copy, "train", epochs=8, gns=True)
    run(["batchlab", "generate"], repo_copy)
    cfg = load_config(repo_copy / "params.yaml")
    monkeypatch.setattr(gns_probes, "PER_EXAMPLE_EVERY", 1)
    single = _final(_fit(cfg, load_data(repo_copy / "data/prepared")))
    set_params(repo_copy, "train", strategy="ddp", nproc=2, threads=1)
    run(["batchlab", "train"], repo_copy)
    with (repo_copy / "reports/history.csv").open() as f:
        last = list(csv.DictReader(f))[-1]
    ddp = {key: float(last[key]) for key in GNS_KEYS}
    _assert_finite_positive(ddp)
    for key in GNS_KEYS:
        assert 0.5 < ddp[key] / single[key] < 2.0, (key, ddp[key], single[key])


@pytest.mark.parametrize(("batch", "every"), [(16, 100), (64, 100), (256, 50), (512, 25), (4096, 5)])
def test_per_example_period_follows_the_rows_a_step_trains(batch: int, every: int) -> None:
    model = torch.nn.Linear(4, 2)
    probe = gns_probes.PerExampleProbe(model, torch.nn.functional.cross_entropy)
    probe.after_backward(1, torch.randn(batch, 4), torch.randint(2, (batch,)))
    probe.small(1, 1.0)
    assert probe.every == every  # the same period every run: the measured steps are reproducible
