"""Step memory measured per batch, and the batch a memory budget allows."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from batchlab.config import Config
from batchlab.study.memory_fit import largest_batch_within
from batchlab.training import gns_probes
from batchlab.training.memory import step_memory_mib

CPU = torch.device("cpu")
FEATURES, CLASSES = 10, 2
CFG = Config()  # the default model: hidden [64, 64], AdamW
WIDTHS = [FEATURES, *CFG.model.hidden_sizes, CLASSES]
N_PARAMS = sum(a * b + b for a, b in pairwise(WIDTHS))
N_TENSORS = 2 * (len(WIDTHS) - 1)  # a weight and a bias per layer


def test_step_memory_strictly_increases_with_batch_size() -> None:
    figures = [step_memory_mib(CFG, FEATURES, CLASSES, b, CPU) for b in (16, 64, 256, 1024)]
    assert all(small < large for small, large in pairwise(figures)), figures


@pytest.mark.parametrize("batch_size", [16, 1024])
def test_step_memory_counts_weights_gradients_adam_state_and_batch_within_a_sane_bound(batch_size: int) -> None:
    # fp32 weights + gradients + AdamW's exp_avg and exp_avg_sq, a float32 step count per tensor,
    # and the batch itself: float32 features, int64 labels
    counted = 4 * N_PARAMS * 4 + 4 * N_TENSORS + batch_size * (4 * FEATURES + 8)
    # activations: no more than 8 float32 copies of every layer's width per row
    bound = 4 * N_PARAMS * 4 + 4 * N_TENSORS + batch_size * 8 * 4 * sum(WIDTHS)
    measured = step_memory_mib(CFG, FEATURES, CLASSES, batch_size, CPU) * 2**20
    assert counted < measured < bound, (counted, measured, bound)


@pytest.mark.parametrize("batch_size", [16, 512])
def test_a_step_the_noise_probe_measures_counts_its_pass_over_the_train_split(batch_size: int) -> None:
    plain = step_memory_mib(CFG, FEATURES, CLASSES, batch_size, CPU) * 2**20
    probing = step_memory_mib(CFG, FEATURES, CLASSES, batch_size, CPU, probing=True) * 2**20
    # the probe's forward and backward over a chunk of the split's rows holds every layer's
    # activations for each of them (at least one float32 per unit), beside the weights, gradients
    # and AdamW's two states, and its two mean gradients
    rows = gns_probes.FULL_SPLIT_CHUNK
    assert probing >= max(plain, 4 * N_PARAMS * 4 + rows * 4 * sum(WIDTHS)), (plain, probing)
    if batch_size == 16:
        assert probing > 2 * plain, (plain, probing)  # the probe's rows dwarf a small batch


def test_step_memory_is_the_same_figure_twice() -> None:
    assert step_memory_mib(CFG, FEATURES, CLASSES, 64, CPU) == step_memory_mib(CFG, FEATURES, CLASSES, 64, CPU)


def line(intercept: float, slope: float, batches: list[int]) -> list[tuple[int, float]]:
    return [(b, intercept + slope * b) for b in batches]


@pytest.mark.parametrize(
    ("intercept", "slope", "budget", "expected"),
    [
        (10.0, 0.5, 60.0, 100),  # exactly on the line
        (10.0, 0.5, 60.4, 100),  # between two batches: the smaller
        (0.3, 0.0017, 0.3 + 0.0017 * 1234, 1234),  # on the line up to float rounding
        (10.0, 0.5, 10.5, 1),
    ],
)
def test_largest_batch_within_finds_the_exact_batch_on_a_line(
    intercept: float, slope: float, budget: float, expected: int
) -> None:
    assert largest_batch_within(budget, line(intercept, slope, [16, 64, 256, 64])) == expected


@pytest.mark.parametrize("budget", [9.0, 10.4])  # below the intercept; above it, below batch 1
def test_largest_batch_within_is_none_when_batch_one_is_over_budget(budget: float) -> None:
    assert largest_batch_within(budget, line(10.0, 0.5, [16, 64])) is None


def test_largest_batch_within_needs_two_distinct_batch_sizes() -> None:
    with pytest.raises(ValueError, match="2 distinct batch sizes"):
        largest_batch_within(100.0, [(64, 40.0), (64, 41.0)])
