"""The study's noise-scale reading against the exact value for the CNN and the transformer, as a
sweep trains and the report reads it (sweep/plan.py's probe period, analysis.reading_at)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import vector_to_parameters

from batchlab.data import build
from batchlab.model import build_model
from batchlab.study import analysis
from batchlab.sweep.plan import experiment_config, plan
from batchlab.training.gns_exact import exact_noise_scale
from batchlab.training.strategy import Strategy
from batchlab.training.train import fit, split_tensors
from tests.support import tiny_config

MODELS = {
    "cnn": {"data": {"source": "digits_images"}, "model": {"name": "cnn", "dropout": 0.1}},
    "transformer": {
        "data": {"source": "sequences", "samples": 600, "classes": 3},
        "model": {"name": "transformer", "dropout": 0.1},
    },
}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _sweep_experiment(name: str, batch: int, epochs: int) -> tuple[Any, Any, dict[str, Any]]:
    """One sweep experiment of `name`'s model, trained as the sweep trains it, and its result row's curve."""
    cfg = tiny_config(**MODELS[name], sweep={"batch_sizes": [batch], "seeds": [0], "epochs": epochs})
    dataset = build(cfg.data)[0]
    (exp,) = plan(cfg, dataset.train.y.shape[0])
    result = fit(experiment_config(cfg, exp), dataset, Strategy(torch.device("cpu")))
    curve = result.val_curve
    row = {
        "curve_steps": [int(p["step"]) for p in curve],
        "curve_b_simple": [p["gns.b_simple"] for p in curve],
        "curve_b_simple_measured_at": [p["gns.measured_at"] for p in curve],
    }
    return cfg, (dataset, dict(result.curve_weights)), row


@pytest.mark.integration  # a 10-epoch fit and exact values of a CNN and a transformer: no tiny unit
@pytest.mark.parametrize(("name", "batch", "epochs"), [("cnn", 32, 10), ("transformer", 16, 10)])
def test_the_reading_the_report_reads_is_the_exact_value_at_its_weights(name: str, batch: int, epochs: int) -> None:
    # At each val point the report could take as the target, the reading it reads there
    # (analysis.reading_at) against the exact value at the weights that reading measured, a val
    # point's (sweep/truth.py computes the same). B_simple at one set of weights scatters 2-10x
    # from one val point to the next (|G|² at an iterate does; tr(Σ) is smooth), so the exact
    # value at the target's own weights is another draw: before, the report held the reading (an
    # older probe's, near the epoch's end) to it and read 0.56x (CNN, batch 16). One reading
    # against the exact value at its own weights scatters by ~0.3 in log (sd over 19 readings of
    # the CNN at batch 16, median 1.06); the median of the ~10 here is within 1.5x of it at ~3
    # standard errors (1.25 * 0.3 / sqrt(10) = 0.12 in log)
    cfg, (dataset, weights), row = _sweep_experiment(name, batch, epochs)
    model = build_model(cfg.model, dataset.input_shape, dataset.n_classes, dataset.vocab).train()
    x, y = split_tensors(dataset.train, torch.device("cpu"))
    exact: dict[int, float] = {}
    ratios: dict[int, float] = {}
    for step in row["curve_steps"]:
        reading, measured = analysis.reading_at(row, step)
        if measured is None:  # before the first probe's weights
            continue
        assert measured in weights, (step, measured)  # a val point's weights: the exact value can be taken there
        if measured not in exact:
            vector_to_parameters(weights[measured], model.parameters())
            exact[measured] = exact_noise_scale(model, F.cross_entropy, x, y).b_simple
        ratios[measured] = reading / exact[measured]
    shown = {k: round(v, 2) for k, v in ratios.items()}
    assert len(ratios) >= epochs - 2 and all(math.isfinite(r) for r in ratios.values()), shown
    assert 1 / 1.5 <= statistics.median(ratios.values()) <= 1.5, shown
