"""The exact noise scale (gns_exact.py) against brute force and against simulated training steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchlab import cli, data, stages
from batchlab.audit import noise
from batchlab.model import load_model
from batchlab.paths import Paths
from batchlab.training import gns_exact
from batchlab.training.gns_exact import exact_noise_scale
from tests.support import tiny_config, write_params


def _problem(dropout: float, rows: int = 48) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 5, generator=gen)
    y = (x[:, 0] + 0.5 * torch.randn(rows, generator=gen) > 0).long()
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(5, 8), nn.ReLU()]
    layers += [nn.Dropout(dropout)] if dropout else []
    model = nn.Sequential(*layers, nn.Linear(8, 2)).double().train()
    return model, x.double(), y


def _gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.fixture(params=["factored", "vmapped"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test runs on both ways of taking the rows' gradients: the MLP's factored one (one
    batched pass a draw) and vmap's row by row, which every other model takes."""
    if request.param == "vmapped":
        monkeypatch.setattr(gns_exact, "row_wise_linears", lambda model, x: None)
    return str(request.param)


def test_the_mlp_takes_the_factored_path_and_a_linear_used_twice_does_not() -> None:
    model, x, _ = _problem(dropout=0.3)
    assert gns_exact.row_wise_linears(model, x) == [model[0], model[3]]
    shared = nn.Linear(5, 5).double()
    twice = nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(5, 2)).double()
    y = torch.zeros(x.shape[0], dtype=torch.long)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        assert (
            gns_exact._factored(twice, gns_exact.row_wise_linears(twice, x) or [], F.cross_entropy, x, y, 2, 16) is None
        )
    assert gns_exact.row_wise_linears(nn.Sequential(nn.Linear(5, 8), nn.ReLU(inplace=True)), x) is None


@pytest.mark.parametrize("chunk", [512, 7])
def test_without_dropout_it_is_the_brute_force_value(path: str, chunk: int) -> None:
    model, x, y = _problem(dropout=0.0)
    per_row = torch.stack([_gradient(model, x[i : i + 1], y[i : i + 1]) for i in range(len(y))])
    mean = per_row.mean(0)
    trace = (per_row - mean).square().sum(1).mean().item()
    exact = exact_noise_scale(model, F.cross_entropy, x, y, chunk=chunk)
    assert exact.draws == 1 and exact.trace_mask == 0.0
    assert exact.grad_sq == pytest.approx(mean.square().sum().item(), rel=1e-9)
    assert exact.trace == pytest.approx(trace, rel=1e-9)
    assert exact.b_simple == pytest.approx(trace / mean.square().sum().item(), rel=1e-9)


@pytest.mark.parametrize("batch", [1, 12, 48])
def test_with_dropout_it_predicts_what_a_training_step_measures(batch: int, path: str) -> None:
    # a step: `batch` rows drawn without replacement, a fresh dropout mask each. The mean of its
    # squared gradient norm over many steps at fixed weights is what the exact figures predict:
    # |G|² + tr(Σ_rows)(N-B)/(B(N-1)) + tr(Σ_mask)/B. At B = N only the masks' noise is left, so
    # batch 48 tests the dropout part alone (a finite-population correction of all of tr(Σ), as
    # the estimators once applied, would predict |G|² there)
    model, x, y = _problem(dropout=0.3)
    exact = exact_noise_scale(model, F.cross_entropy, x, y, draws=256, chunk=20)  # its own mask noise ≪ the test's
    assert exact.trace_mask > 0.1 * exact.trace  # dropout is a real part of the noise here
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    steps = 3000
    batches = [torch.randperm(len(y), generator=gen)[:batch] for _ in range(steps)]
    measured = torch.stack([_gradient(model, x[idx], y[idx]).square().sum() for idx in batches])
    standard_error = measured.std().item() / steps**0.5
    assert abs(measured.mean().item() - exact.batch_grad_sq(batch)) < 4 * standard_error
    rows_only = exact.grad_sq + exact.trace * (len(y) - batch) / (batch * (len(y) - 1))
    if batch == len(y):  # the simulation tells the two apart
        assert abs(measured.mean().item() - rows_only) > 8 * standard_error


def test_it_leaves_the_weights_the_mode_and_the_global_rng_as_they_were(path: str) -> None:
    model, x, y = _problem(dropout=0.3)
    before = [p.detach().clone() for p in model.parameters()]
    state = torch.get_rng_state()
    first = exact_noise_scale(model, F.cross_entropy, x, y, draws=4, seed=7)
    assert torch.equal(torch.get_rng_state(), state) and model.training
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert exact_noise_scale(model, F.cross_entropy, x, y, draws=4, seed=7) == first  # reproducible


@pytest.mark.integration
def test_noise_scale_command_reports_the_exact_value_of_the_saved_model(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = Paths(workdir)
    # the probe reads once, at step 108 of 182 (later on, |G|² is below the probe's mask noise here)
    cfg = tiny_config(model={"dropout": 0.2}, train={"epochs": 14, "gns_every": 107})
    write_params(workdir, cfg.model_dump())
    assert cli.main(["--out", str(workdir), "noise-scale"]) == 1  # nothing trained yet: a one-line error
    assert "train first" in capsys.readouterr().err
    stages.generate(cfg, paths)
    stages.train(cfg, paths)
    model, _ = load_model(paths.model)
    dataset = data.load(paths.data)
    x, y = torch.from_numpy(dataset.train.x), torch.from_numpy(dataset.train.y)
    expected = exact_noise_scale(model.train(), F.cross_entropy, x, y, draws=4)
    text = noise.report(paths, draws=4)
    assert f"exact B_simple = {expected.b_simple:.1f}" in text and "4 dropout masks a row" in text
    saved = json.loads((paths.reports / "train_summary.json").read_text())["gns_at_saved_weights"]
    assert saved["probes"] == 4 and saved["b_simple_ci95_low"] < saved["b_simple"] < saved["b_simple_ci95_high"]
    ratio = saved["b_simple"] / expected.b_simple
    assert f"at the same weights = {saved['b_simple']:.1f}" in text and f": {ratio:.2f}x exact" in text
