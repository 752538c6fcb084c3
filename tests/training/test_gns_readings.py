"""A noise reading's standard error against the exact value (every train row's gradient), and the
figure a plain training reports (at the weights it keeps) within 1.5x of the exact value there."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from batchlab import data
from batchlab.config import load_config, parse_config
from batchlab.training.gns_estimates import Reading, per_row_estimate, standard_error
from batchlab.training.gns_exact import exact_noise_scale
from batchlab.training.gns_probes import FullSplitProbe
from batchlab.training.strategy import Strategy
from batchlab.training.train import fit, initial_model, split_tensors

REPO = Path(__file__).resolve().parents[2]
CPU = Strategy(torch.device("cpu"))


@pytest.mark.integration  # a default training and the exact value at 6 of its iterates (~15 s)
def test_a_readings_interval_covers_the_exact_value_at_its_stated_level_and_is_not_wider() -> None:
    """15 readings (fresh masks and rows each) at each of 6 iterates of a default run, against the
    exact value there: the log-scale 95% interval covers it in 85-99% of them, and the errors are
    not far smaller than the standard errors say (the median |z| of a calibrated error is 0.67; the
    bound that took all the masks' noise along G read 0.1-0.3 here). On params.yaml's problem: with
    a train split within ROW_SAMPLE rows every row's gradient is taken and the interval errs wide."""
    raw = load_config(REPO / "params.yaml").model_dump()
    raw["train"].update(gns=False, eval_every_steps=43, curve_weights=True, early_stopping_patience=0)
    cfg = parse_config(raw)
    dataset, _ = data.build(cfg.data)
    result = fit(cfg, dataset, CPU)
    x, y = split_tensors(dataset.train, torch.device("cpu"))
    model = initial_model(cfg, dataset.input_shape, dataset.n_classes)
    covered, z = [], []
    kept = result.curve_weights
    points = [kept[round(i * (len(kept) - 1) / 5)] for i in range(6)]
    for _, weights in points:
        vector_to_parameters(weights, model.parameters())
        exact = exact_noise_scale(model.train(), F.cross_entropy, x, y).b_simple
        probe = FullSplitProbe(model, F.cross_entropy, x, y, every=1)
        for k in range(15):
            torch.manual_seed(100 + k)  # the masks of the two passes
            m = probe.measure(2 + k)  # the rows, one mask each
            assert m.row_sq is not None and m.row_sq_var is not None and m.cross_var is not None
            g, t = per_row_estimate(m.cross.item(), m.half_diff_sq.item(), m.row_sq.item(), m.rows, x.shape[0])
            reading = Reading(g, t, standard_error(g, t, m.cross_var.item(), m.row_sq_var.item()), 1)
            low, high = reading.interval
            covered.append(low <= exact <= high)
            z.append(abs(math.log(reading.b_simple / exact)) * reading.b_simple / reading.se)
    coverage = sum(covered) / len(covered)
    assert 0.85 <= coverage <= 0.99, coverage
    assert statistics.median(z) > 0.4, statistics.median(z)


@pytest.mark.integration  # three default trainings and the exact value at each (~40 s)
def test_a_default_trainings_reported_noise_scale_is_within_1_5x_of_the_exact_value_at_its_weights() -> None:
    """params.yaml's problem, trained for 4, 10 and 20 epochs: the figure train_summary.json and
    `batchlab noise-scale` report (four probes pooled at the kept weights) against the exact value
    at those weights. Before, the last epoch's single reading, taken at other weights, read 3.47x."""
    base = load_config(REPO / "params.yaml")
    dataset, _ = data.build(base.data)
    x, y = split_tensors(dataset.train, torch.device("cpu"))
    ratios = []
    for epochs in (4, 10, 20):
        raw = base.model_dump()
        raw["train"].update(epochs=epochs)
        result = fit(parse_config(raw), dataset, CPU)
        saved = result.noise_at_saved
        exact = exact_noise_scale(result.model.train(), F.cross_entropy, x, y).b_simple
        ratios.append(saved["b_simple"] / exact)
        assert saved["probes"] == 4 and saved["b_simple_ci95_low"] < saved["b_simple"] < saved["b_simple_ci95_high"]
    assert all(1 / 1.5 <= r <= 1.5 for r in ratios), ratios


@pytest.mark.integration  # three adaptive trainings of the default study and the exact value at each decision
def test_every_adaptive_decision_in_the_default_study_reads_within_1_5x_of_the_exact_value_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The adaptive row of the default study (from batch 16 at its scaled lr, up to 512, the time
    rule on this CPU's step time): each decision's reading, pooled until its standard error is
    within 15% (at most 4 probes), against the exact value at the weights it measured. One probe
    alone read 0.57x and 0.60x at two of five seeds' second decision."""
    base = load_config(REPO / "params.yaml")
    dataset, _ = data.build(base.data)
    x, y = split_tensors(dataset.train, torch.device("cpu"))
    weights: dict[tuple[int, int], torch.Tensor] = {}
    measure = FullSplitProbe.measure

    def kept(self: FullSplitProbe, step: int, draw: int = 0) -> Any:
        weights.setdefault((step, draw), parameters_to_vector(self.model.parameters()).detach().clone())
        return measure(self, step, draw)

    monkeypatch.setattr(FullSplitProbe, "measure", kept)
    ratios = []
    for seed in (0, 2, 4):
        raw = base.model_dump()
        raw["train"].update(batch_size=16, lr=0.0015, seed=seed, adaptive_batch=True, max_batch_size=512,
                            adapt_step_time=[2e-4, 1.1e-6, 0.0165], early_stopping_patience=0)  # fmt: skip
        weights.clear()
        result = fit(parse_config(raw), dataset, CPU)
        model = initial_model(parse_config(raw), dataset.input_shape, dataset.n_classes)
        decided = [d for d in result.batch_schedule if math.isfinite(d["b_noise"])]
        assert len(decided) >= 2 and any(d["step"] > 0 for d in decided)
        for d in decided:
            vector_to_parameters(weights[(d["step"], 0)], model.parameters())
            exact = exact_noise_scale(model.train(), F.cross_entropy, x, y).b_simple
            ratios.append(d["b_noise"] / exact)
    assert all(1 / 1.5 <= r <= 1.5 for r in ratios), ratios
