"""The critical-batch fit: exact on data that follows the model, honest when it cannot fit."""

from __future__ import annotations

import math
import random

import pytest

from batchlab.study import critical


def _steps(batch: int, s_min: float = 40.0, b_crit: float = 250.0) -> float:
    return s_min * (1 + b_crit / batch)  # S = S_min (1 + B_crit/B) satisfies (S/S_min-1)(E/E_min-1) = 1


def test_fit_recovers_b_crit_s_min_and_e_min_exactly_on_synthetic_data() -> None:
    fit = critical.fit([(b, _steps(b)) for b in (16, 32, 64, 128, 256, 512)])  # type: ignore[misc]
    assert isinstance(fit, critical.Fit)
    assert fit.b_crit == pytest.approx(250.0, rel=1e-9)
    assert fit.s_min == pytest.approx(40.0, rel=1e-9)
    assert fit.e_min == pytest.approx(40.0 * 250.0, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.steps_at(64) == pytest.approx(_steps(64))
    assert math.isnan(fit.b_crit_low)  # one value per batch size: no interval to state


def test_interval_over_seeds_brackets_b_crit_and_is_reproducible() -> None:
    noise = {0: 0.95, 1: 1.0, 2: 1.05}
    points = [(b, round(_steps(b) * noise[seed])) for b in (16, 32, 64, 128, 256, 512) for seed in noise]
    fit = critical.fit(points)
    assert isinstance(fit, critical.Fit)
    assert fit.b_crit_low < fit.b_crit < fit.b_crit_high
    again = critical.fit(points)
    assert isinstance(again, critical.Fit) and (again.b_crit_low, again.b_crit_high) == (
        fit.b_crit_low,
        fit.b_crit_high,
    )


def test_fewer_than_three_batch_sizes_reaching_the_target_is_no_fit_and_says_why() -> None:
    fit = critical.fit([(16, 100), (32, 60), (64, None), (128, None)])
    assert isinstance(fit, critical.NoFit) and "only 2 batch size(s) reached the target" in fit.reason


def test_steps_that_keep_halving_give_no_critical_batch_size() -> None:
    # perfect scaling at every size, with a little noise: E does not grow, so no B_crit in range
    fit = critical.fit([(16, 1000), (32, 510), (64, 250), (128, 126)])
    assert isinstance(fit, critical.NoFit) and "no critical batch size" in fit.reason


def test_auto_target_is_reached_by_every_curve() -> None:
    curves = [[1.0, 0.5, 0.3], [1.0, 0.6, 0.4, 0.35], [0.9, 0.45]]
    target = critical.auto_target(curves)
    assert target == pytest.approx(0.45 * 1.02)
    assert all(critical.first_reach(list(range(len(c))), c, target) is not None for c in curves)
    assert critical.first_reach([10, 20], [0.5, 0.4], 0.3) is None


def test_the_crossing_is_read_between_scored_points_whatever_the_scoring_interval() -> None:
    """A curve 1/s through the target at step 196.25, scored every h steps at several offsets: the
    first scored point at or below it is late by up to h (first order), the crossing read between
    points is off by at most the chord's h²/(4s) on this curve (second order: 0.001 steps at h = 1,
    0.5 at h = 20)."""
    truth, target = 196.25, 0.2

    def loss(s: float) -> float:
        return 0.1 + 0.1 * truth / s

    for every, offset in ((1, 1), (10, 10), (10, 7), (20, 20), (20, 3), (50, 50), (50, 30)):
        steps = list(range(offset, 2000, every))
        losses = [loss(s) for s in steps]
        first = critical.first_reach(steps, losses, target)
        assert first is not None and 0 <= first - truth < every
        at = steps.index(first)
        found = critical.crossing(steps, losses, at, target)
        assert abs(found - truth) <= every**2 / (4 * truth) * 1.05 + 1e-9, (every, offset, found)
        assert truth <= found <= first  # a convex curve's chord crosses late, never past the point
        examples = [64 * s for s in steps]  # any axis: the same share of the way
        assert critical.crossing(examples, losses, at, target) == pytest.approx(64 * found)
    assert critical.crossing([5, 10], [0.1, 0.05], 0, 0.2) == 5.0  # already there at the first point


# the default study's spread: the seed-to-seed coefficient of variation of the steps to the target
# at batch 16 ... 512 (from its committed table: 810 ± 317, 376 ± 143, 237 ± 15, 130 ± 30, 82 ± 9,
# 61 ± 20 over 3 seeds), on an exact hyperbola with its fitted S_min and B_crit
SPREAD = {16: 0.158, 32: 0.153, 64: 0.025, 128: 0.093, 256: 0.044, 512: 0.132}


def _simulated_study(rng: random.Random, seeds: int) -> list[tuple[int, int | None]]:
    return [
        (b, max(1, round(_steps(b, 38.7, 303.0) * (1 + cv * rng.gauss(0, 1)))))
        for b, cv in SPREAD.items()
        for _ in range(seeds)
    ]


@pytest.mark.parametrize("seeds", [3, 5])
def test_the_95_interval_covers_the_true_b_crit_in_at_least_93_percent_of_simulated_studies(seeds: int) -> None:
    rng, covered, studies = random.Random(seeds), 0, 200
    for _ in range(studies):
        fit = critical.fit(_simulated_study(rng, seeds))
        covered += isinstance(fit, critical.Fit) and fit.b_crit_low <= 303.0 <= fit.b_crit_high
    assert covered / studies >= 0.93, f"covered {covered} of {studies}"


def test_the_20_percent_excess_batch_is_exact_on_the_hyperbola() -> None:
    # S(B)·B / (S(B0)·B0) = (B + B_crit) / (B0 + B_crit): it reaches 1.2 at B = 1.2·B0 + 0.2·B_crit
    points = [(b, _steps(b, 40.0, 250.0)) for b in (16, 32, 64, 128, 256, 512)]
    assert critical.excess_batch(points) == pytest.approx(1.2 * 16 + 0.2 * 250.0, rel=1e-12)  # 69.2
    assert math.isnan(critical.excess_batch([(b, 1000 / b) for b in (16, 32, 64)]))  # perfect scaling
    fit = critical.fit(points)  # type: ignore[arg-type]
    assert isinstance(fit, critical.Fit) and fit.b_excess == pytest.approx(69.2, rel=1e-12)
