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
from batchlab.paths import Paths
from batchlab.training import gns, gns_estimates, gns_probes
from batchlab.training.gns import NoiseScale
from batchlab.training.gns_exact import exact_noise_scale
from batchlab.training.strategy import Strategy
from batchlab.training.train import TrainResult, fit
from tests.support import run, set_params, tiny_config
from tests.support.fits import StopAfter

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


@pytest.mark.parametrize(("rows", "probe_rows", "mask_sd"), [(200, 200, 0.0), (200, 200, 0.6), (200, 120, 0.6)])
def test_full_split_estimate_recovers_a_known_noise_scale(rows: int, probe_rows: int, mask_sd: float) -> None:
    # per-row mean gradients g_i and a dropout-like noise: each draw of row i is g_i + e with
    # e ~ N(0, mask_sd² I), fresh per step and per probe pass. Exact: |G|² = |mean g_i|²,
    # tr(Σ) = mean |g_i - G|² + dims·mask_sd². Steps: 16 rows without replacement; the probe's
    # two passes over `probe_rows` rows (all of them, or a random subset of them each time)
    gen = torch.Generator().manual_seed(1)
    dims, batch = 20, 16
    per_row = torch.randn(rows, dims, generator=gen, dtype=torch.float64) + 0.05
    true_grad = per_row.mean(0)
    trace = (per_row - true_grad).square().sum(1).mean().item() + dims * mask_sd**2
    assert trace / true_grad.square().sum().item() > rows / 3  # where the finite population matters

    def mean_gradient(idx: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(len(idx), dims, generator=gen, dtype=torch.float64) * mask_sd
        return (per_row[idx] + noise).mean(0)

    estimates = []
    for _ in range(3000):
        idx = torch.randperm(rows, generator=gen)[:probe_rows]
        first, second = mean_gradient(idx), mean_gradient(idx)
        steps = [mean_gradient(torch.randperm(rows, generator=gen)[:batch]).square().sum() for _ in range(8)]
        estimates.append(gns_estimates.full_split_estimate(
            float(first @ second), float((first - second).square().sum() / 2), float(torch.stack(steps).mean()),
            probe_rows, batch, rows,
        ))  # fmt: skip
    grad_sq, trace_sigma = (statistics.fmean(e[k] for e in estimates) for k in (0, 1))
    assert grad_sq == pytest.approx(true_grad.square().sum().item(), rel=0.05)
    assert trace_sigma == pytest.approx(trace, rel=0.03)


def test_a_resumed_run_reads_what_an_unbroken_one_does() -> None:
    # the windows open across a checkpoint: the steps' norms before it and the measurement waiting
    gen = torch.Generator().manual_seed(2)
    norms = [torch.rand((), generator=gen) + 1 for _ in range(40)]
    measure = gns_estimates.FullSplitMeasure(torch.tensor(0.5), torch.tensor(0.01), 100, half_window=6)

    def run(noise: NoiseScale, steps: range) -> list[float]:
        for step in steps:
            noise.record_step(norms[step], measure if step % 10 == 9 else None, 8)
        return noise.settle().b_simple

    unbroken = run(NoiseScale(population=200), range(40))
    first = NoiseScale(population=200)
    run(first, range(22))  # step 20's window waits for 6 more steps
    resumed = NoiseScale(population=200)
    resumed.load_state_dict(first.state_dict())
    assert len(unbroken) == 1 + 3 and math.isfinite(unbroken[-1])  # steps 10, 20 and 30, each read 6 later
    assert run(resumed, range(22, 40)) == pytest.approx(unbroken[1:])  # from step 10's reading on


def test_the_probes_rows_hang_on_its_step_alone_so_a_resumed_run_draws_what_an_unbroken_one_did(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A split larger than FULL_SPLIT_ROWS is probed on rows drawn for the step: drawn from a
    generator seeded once per run, a resumed run (a Dask worker killed mid-experiment) read other
    rows from then on than the unbroken run (found by the sweep's chaos test)."""
    monkeypatch.setattr(gns_probes, "FULL_SPLIT_ROWS", 16)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 3))
    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))

    def probe() -> gns_probes.FullSplitProbe:
        return gns_probes.FullSplitProbe(model, torch.nn.functional.cross_entropy, x, y, every=5)

    def read(measured: gns_estimates.FullSplitMeasure) -> list[float]:
        return [float(measured.cross), float(measured.half_diff_sq), float(measured.row_sq or math.nan)]

    unbroken = probe()
    torch.manual_seed(1)
    unbroken.measure(5)
    torch.manual_seed(2)  # the training's RNG as the checkpoint restores it
    at_10 = read(unbroken.measure(10))
    torch.manual_seed(2)
    assert read(probe().measure(10)) == at_10
    assert read(probe().measure(15)) != at_10  # another step: other rows


def test_an_mlps_rows_own_gradients_from_one_pass_equal_vmaps_row_by_row() -> None:
    """linear_row_squares (one batched forward and backward: |δ|²·(|a|² + 1) per Linear) against the
    rows' own gradients taken one row at a time by vmap: equal without dropout, a frozen first
    layer included; with dropout, each row its own mask, equal in expectation (200 draws each)."""
    import statistics

    from torch import nn

    torch.manual_seed(0)
    x, y = torch.randn(300, 8), torch.randint(0, 3, (300,))
    loss = torch.nn.functional.cross_entropy
    plain = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 3))
    fast = gns_probes.linear_row_squares(plain, loss, x, y)
    assert fast is not None
    assert torch.allclose(fast, gns_probes._vmapped_row_squares(plain, loss, x, y), rtol=1e-5)
    plain[0].requires_grad_(False)
    fast = gns_probes.linear_row_squares(plain, loss, x, y)
    assert fast is not None
    assert torch.allclose(fast, gns_probes._vmapped_row_squares(plain, loss, x, y), rtol=1e-5)

    masked = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    one = [float(gns_probes.linear_row_squares(masked, loss, x, y)[0]) for _ in range(200)]  # type: ignore[index]
    rowwise = [float(gns_probes._vmapped_row_squares(masked, loss, x, y)[0]) for _ in range(200)]
    se = math.hypot(statistics.stdev(one), statistics.stdev(rowwise)) / math.sqrt(200)
    assert abs(statistics.fmean(one) - statistics.fmean(rowwise)) < 4 * se

    class Centred(nn.Module):  # a forward of its own may mix rows: vmap's
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 3)

        def forward(self, rows: torch.Tensor) -> torch.Tensor:
            return self.layer(rows - rows.mean(0))

    assert gns_probes.linear_row_squares(Centred(), loss, x, y) is None
    assert gns_probes.linear_row_squares(nn.Sequential(nn.Linear(8, 3), nn.BatchNorm1d(3)), loss, x, y) is None


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
    monkeypatch.setattr(gns, "DECAY", 0.9)
    cfg = tiny_config(
        model={"dropout": dropout},
        train={"epochs": 30, "lr": 1e-9, "schedule": "constant", "grad_accum_steps": accum},
    )
    result = _fit(cfg, tiny_dataset)
    assert _final(result) == pytest.approx(_exact(result.model, tiny_dataset), rel=0.15)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_reading_follows_the_exact_noise_scale_through_training(
    dropout: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a synthetic problem with a known answer at every point: the weights after every step
    # (a val point each step, train.curve_weights), every train row's gradient there. A probe
    # every 128th step at step s measures the weights of s - 1 steps (before its step's update),
    # its reading complete there (tr(Σ) from 512 of the 1400 rows' own gradients). One reading
    # scatters by 20-40%, now and then more (0.64-2.43x in one run with dropout here, a few rows
    # hold most of the gradient late on; within 15% on a still model: the test above): the median
    # over the run is the claim, and two readings in three within 1.5x
    cfg = tiny_config(
        data={"samples": 2000},
        model={"dropout": dropout, "hidden_sizes": [32]},
        train={"epochs": 30, "curve_weights": True, "eval_every_steps": 1},
    )
    dataset = build(cfg.data)[0]
    every = 128
    _probe_every(monkeypatch, every)
    result = _fit(cfg, dataset)
    model, curve = result.model, result.val_curve
    ratios = []
    for probe in range(every, len(curve) - every, every):
        reading = curve[probe + every // 2]["gns.b_simple"]  # step probe + every // 2 + 1: complete
        step, weights = result.curve_weights[probe - 2]
        assert step == probe - 1  # the weights the probe saw: before its step's update
        torch.nn.utils.vector_to_parameters(weights, model.parameters())
        ratios.append(reading / _exact(model, dataset, draws=16)["gns.b_simple"])
    shown = str([round(r, 2) for r in ratios])
    read = [r for r in ratios if math.isfinite(r)]  # late on |G|² can read ≤ 0: no reading, counted
    assert len(ratios) >= 8 and len(read) >= len(ratios) - 1, shown
    assert 0.7 <= statistics.median(read) <= 1.3, shown
    assert sum(1 / 1.5 <= r <= 1.5 for r in read) >= 2 / 3 * len(read), shown


def test_per_example_path_logs_finite_positive_noise_scale(tiny_dataset: Dataset, every_step: None) -> None:
    result = _fit(tiny_config(train={"epochs": 3}), tiny_dataset)
    assert all(set(row) >= GNS_KEYS for row in result.history)
    _assert_finite_positive(_final(result))
    assert _final(result)["gns.b_simple"] == pytest.approx(
        _final(result)["gns.trace_sigma"] / _final(result)["gns.grad_sq"]
    )


def test_default_period_measures_a_longer_run(tiny_dataset: Dataset) -> None:
    # 13 steps an epoch: the default period (271 steps for 420 rows at batch 32) has read by epoch 22
    _assert_finite_positive(_final(_fit(tiny_config(train={"epochs": 22}), tiny_dataset)))


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


@pytest.mark.integration
def test_train_stage_writes_val_curve_csv_and_logs_undefined_noise_scale_to_mlflow(workdir: Path) -> None:
    # 4 epochs of 13 steps, the first shorter than the default period (271): gns.b_simple is NaN there
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    cfg = tiny_config(train={"eval_every_steps": 10}, tracking={"enabled": True, "tracking_uri": uri})
    paths = Paths(workdir)
    stages.generate(cfg, paths)
    info = stages.train(cfg, paths)
    with (workdir / "reports/val_curve.csv").open() as f:
        curve = list(csv.DictReader(f))
    assert [int(float(p["step"])) for p in curve] == [10, 20, 30, 40, 50]
    assert set(curve[0]) == {"step", "examples", "val_loss", "gns.b_simple", "gns.measured_at"}
    with (workdir / "reports/history.csv").open() as f:
        assert set(next(csv.DictReader(f))) >= GNS_KEYS
    logged = MlflowClient(uri).get_metric_history(info["run_id"], "gns.b_simple")
    assert [m.step for m in logged] == [1, 2, 3, 4] and math.isnan(logged[0].value)
    # a later run without the curve leaves no stale file
    stages.train(tiny_config(tracking={"enabled": True, "tracking_uri": uri}), paths)
    assert not (workdir / "reports/val_curve.csv").exists()


@pytest.mark.integration
def test_ddp_noise_scale_agrees_with_single_process(repo_copy: Path) -> None:
    # the same data and seed: DDP's weights match one process's, so both measure the same training.
    # both take the split's mean gradient at fixed weights (under DDP each rank half of its rows,
    # summed in one all-reduce) after steps 100 and 200 of 221 (train.gns_every: the cost model's
    # period for these 420 rows is longer than the run, which then reads nothing), and their sampled
    # rows' own gradients (each rank its share); their weights differ a little (#29). A factor of 2
    # is several standard errors of a reading, and far below what a missing world-size or
    # reduction would give.
    set_params(repo_copy, "train", epochs=17, gns=True, gns_every=100)
    run(["batchlab", "generate"], repo_copy)
    cfg = load_config(repo_copy / "params.yaml")
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
    ("batch", "dropout", "every"), [(16, 0.1, 840), (64, 0.1, 688), (512, 0.1, 255), (16, 0.0, 563)]
)
def test_full_split_period_follows_its_cost_model(batch: int, dropout: float, every: int) -> None:
    # params.yaml's 2800 train rows: the periods gns_probes' comment states (two passes with dropout)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(dropout), torch.nn.Linear(8, 2))
    probe = gns_probes.FullSplitProbe(
        model, torch.nn.functional.cross_entropy, torch.randn(2800, 4), torch.randint(2, (2800,))
    )
    probe.after_backward(1, torch.randn(batch, 4), torch.randint(2, (batch,)))
    probe.small(1)
    assert probe.every == every  # the same period every run: the measured steps are reproducible


class _ItemInForward(torch.nn.Module):
    """A user's module whose forward torch.func cannot run a row at a time (`.item()` on data)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) * (1.0 if x.abs().max().item() < 1e9 else 0.0)


def test_a_forward_vmap_cannot_run_falls_back_to_the_steps_norms_told_once(caplog: pytest.LogCaptureFixture) -> None:
    model = _ItemInForward()
    probe = gns_probes.FullSplitProbe(
        model, torch.nn.functional.cross_entropy, torch.randn(300, 4), torch.randint(2, (300,)), every=5
    )
    measured = [probe.small(step) for step in range(1, 12)]
    taken = [m for m in measured if m is not None]
    assert len(taken) == 2 and all(m.row_sq is None and math.isfinite(float(m.cross)) for m in taken)
    assert sum("torch.func.vmap can run" in r.getMessage() for r in caplog.records) == 1
    # a forward it can run: the rows' own gradients are taken
    plain = gns_probes.FullSplitProbe(
        torch.nn.Linear(4, 2), torch.nn.functional.cross_entropy, torch.randn(300, 4), torch.randint(2, (300,)), every=5
    )
    assert all(m.row_sq is not None for m in (plain.small(s) for s in range(1, 12)) if m is not None)
