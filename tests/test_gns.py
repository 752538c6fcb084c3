"""The gradient noise scale (gns.py, measured through strategy.py) and the step-granular val curve."""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from batchlab import stages
from batchlab.config import Config, load_config
from batchlab.data import Dataset, build
from batchlab.data import load as load_data
from batchlab.training import gns, gns_probes
from batchlab.training.gns import NoiseScale
from batchlab.training.gns_exact import exact_noise_scale
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


def _probe_every(monkeypatch: pytest.MonkeyPatch, every: int) -> None:
    monkeypatch.setattr(gns_probes, "full_split_every", lambda rows, batch, passes: every)


@pytest.fixture
def every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The noise probe at every step: a tiny run has too few steps for the default period."""
    _probe_every(monkeypatch, 1)


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


def _exact(model: torch.nn.Module, dataset: Dataset, draws: int = 64) -> dict[str, float]:
    """The exact figures from every train row's gradient at the model's weights (gns_exact.py)."""
    x, y = torch.from_numpy(dataset.train.x), torch.from_numpy(dataset.train.y)
    exact = exact_noise_scale(model.train(), torch.nn.functional.cross_entropy, x, y, draws=draws)
    return {"gns.grad_sq": exact.grad_sq, "gns.trace_sigma": exact.trace, "gns.b_simple": exact.b_simple}


@pytest.mark.parametrize(("accum", "dropout"), [(1, 0.0), (4, 0.0), (1, 0.3)])
def test_probes_recover_the_exact_noise_scale_of_a_still_model(
    tiny_dataset: Dataset, monkeypatch: pytest.MonkeyPatch, accum: int, dropout: float
) -> None:
    # lr 1e-9: the weights (so the true noise scale) stay put while the probe measures them, and
    # a long EMA averages its noise away. With dropout its masks are part of the noise, in the
    # probe (two passes with independent masks, the steps' own masks) and in the exact value alike
    _probe_every(monkeypatch, 8)  # the steps' norms 4 each side of a probe
    monkeypatch.setattr(gns, "FULL_SPLIT_DECAY", 0.9)
    cfg = tiny_config(
        model={"dropout": dropout},
        train={"epochs": 30, "lr": 1e-9, "schedule": "constant", "grad_accum_steps": accum},
    )
    result = _fit(cfg, tiny_dataset)
    assert _final(result) == pytest.approx(_exact(result.model, tiny_dataset), rel=0.15)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_reading_follows_the_exact_noise_scale_through_training(dropout: float) -> None:
    # a synthetic problem with a known answer at every point: the weights after every step
    # (a val point each step, train.curve_weights), every train row's gradient there. The default
    # probe period and memory: a probe at step s measures the weights of s - 1 steps (before its
    # step's update), and its reading is complete half a period later. One reading scatters by
    # 20-40% on a moving model (±8% on a still one: the test above): the median over the run is
    # the claim, and no reading is off by 2x
    cfg = tiny_config(
        data={"samples": 2000},
        model={"dropout": dropout, "hidden_sizes": [32]},
        train={"epochs": 30, "curve_weights": True, "eval_every_steps": 1},
    )
    dataset = build(cfg.data)[0]
    every = gns_probes.full_split_every(dataset.train.y.shape[0], 32, 2 if dropout else 1)
    result = _fit(cfg, dataset)
    model, curve = result.model, result.val_curve
    ratios = []
    for probe in range(every, len(curve) - every, every):
        reading = curve[probe + every // 2]["gns.b_simple"]  # step probe + every // 2 + 1: complete
        torch.nn.utils.vector_to_parameters(result.curve_weights[probe - 2], model.parameters())  # step probe - 1
        ratios.append(reading / _exact(model, dataset, draws=16)["gns.b_simple"])
    shown = str([round(r, 2) for r in ratios])
    assert len(ratios) >= 8, shown
    assert 0.7 <= statistics.median(ratios) <= 1.3, shown
    assert all(0.5 <= r <= 2.0 for r in ratios), shown


def test_per_example_path_logs_finite_positive_noise_scale(tiny_dataset: Dataset, every_step: None) -> None:
    result = _fit(tiny_config(train={"epochs": 3}), tiny_dataset)
    assert all(set(row) >= GNS_KEYS for row in result.history)
    _assert_finite_positive(_final(result))
    assert _final(result)["gns.b_simple"] == pytest.approx(
        _final(result)["gns.trace_sigma"] / _final(result)["gns.grad_sq"]
    )


def test_default_period_measures_a_longer_run(tiny_dataset: Dataset) -> None:
    # 13 steps an epoch: the default period (28 steps for 420 rows at batch 32) has measured by epoch 16
    _assert_finite_positive(_final(_fit(tiny_config(train={"epochs": 16}), tiny_dataset)))


def test_gns_changes_no_weight_and_off_logs_no_gns_keys(tiny_dataset: Dataset, every_step: None) -> None:
    # dropout draws from the global RNG in every step: the probe's passes must not move it
    on = _fit(tiny_config(model={"dropout": 0.3}, train={"gns": True}), tiny_dataset)
    off = _fit(tiny_config(model={"dropout": 0.3}, train={"gns": False}), tiny_dataset)
    a, b = on.model.state_dict(), off.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not any(key.startswith("gns.") for row in off.history for key in row)
    _assert_finite_positive(_final(on))


def test_grad_accumulation_path_gives_finite_positive_noise_scale(tiny_dataset: Dataset, every_step: None) -> None:
    result = _fit(tiny_config(train={"grad_accum_steps": 4, "epochs": 3}), tiny_dataset)
    _assert_finite_positive(_final(result))


def test_fp16_noise_scale_is_measured_after_unscaling(tiny_dataset: Dataset, every_step: None) -> None:
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
    # 4 epochs of 13 steps, the first shorter than the default period (28): gns.b_simple is NaN there
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
    # DDP pairs 16 rows with 32 (noisy, every step); one process measures |G|² over the whole
    # split (every step here). A factor of 2 is several standard errors of either EMA, and far
    # below what a missing world-size or scale factor would give.
    set_params(repo_copy, "train", epochs=8, gns=True)
    run(["batchlab", "generate"], repo_copy)
    cfg = load_config(repo_copy / "params.yaml")
    _probe_every(monkeypatch, 1)
    single = _final(_fit(cfg, load_data(repo_copy / "data/prepared")))
    set_params(repo_copy, "train", strategy="ddp", nproc=2, threads=1)
    run(["batchlab", "train"], repo_copy)
    with (repo_copy / "reports/history.csv").open() as f:
        last = list(csv.DictReader(f))[-1]
    ddp = {key: float(last[key]) for key in GNS_KEYS}
    _assert_finite_positive(ddp)
    for key in GNS_KEYS:
        assert 0.5 < ddp[key] / single[key] < 2.0, (key, ddp[key], single[key])


@pytest.mark.parametrize(
    ("batch", "dropout", "every"), [(16, 0.1, 246), (64, 0.1, 213), (512, 0.1, 96), (16, 0.0, 123)]
)
def test_full_split_period_follows_its_cost_model(batch: int, dropout: float, every: int) -> None:
    # params.yaml's 2800 train rows: the periods gns_probes' comment states (two passes with dropout)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(dropout), torch.nn.Linear(8, 2))
    probe = gns_probes.FullSplitProbe(
        model, torch.nn.functional.cross_entropy, torch.randn(2800, 4), torch.randint(2, (2800,))
    )
    probe.after_backward(1, torch.randn(batch, 4), torch.randint(2, (batch,)))
    probe.small(1, 1.0)
    assert probe.every == every  # the same period every run: the measured steps are reproducible
