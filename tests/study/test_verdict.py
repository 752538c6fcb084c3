"""The verdict never calls a difference inside the noise "best"."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from batchlab.study import verdict


def test_mean_ci_uses_students_t() -> None:
    mean, half = verdict.mean_ci([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.302653 * 1.0 / math.sqrt(3), rel=1e-5)
    assert math.isnan(verdict.mean_ci([1.0])[1])


def test_indistinguishable_results_are_called_so_and_the_fastest_is_recommended() -> None:
    # batch 32 is ahead by one test example on two seeds and behind on the third: noise
    f1 = {16: {0: 0.964, 1: 0.962, 2: 0.966}, 32: {0: 0.966, 1: 0.964, 2: 0.963}, 64: {0: 0.963, 1: 0.964, 2: 0.965}}
    result = verdict.decide(f1, {16: 3.0, 32: 1.5, 64: 0.9}, {16: 1e4, 32: 2e4, 64: 4e4}, n_test=600)
    assert result.best == 32 and result.tied == [16, 32, 64]
    assert result.recommended == 64  # the fastest to the target among those that cannot be told apart
    assert "No batch size is measurably worse" in result.text and "600 rows" in result.text


def test_consistently_worse_batch_is_excluded_from_the_recommendation() -> None:
    f1 = {16: {0: 0.96, 1: 0.961, 2: 0.962}, 512: {0: 0.90, 1: 0.905, 2: 0.899}}
    result = verdict.decide(f1, {16: 5.0, 512: 0.5}, {16: 1e4, 512: 9e4}, n_test=600)
    assert result.tied == [16] and result.recommended == 16
    assert "Measurably worse: 512" in result.text


def test_one_seed_says_no_ranking_can_be_trusted() -> None:
    result = verdict.decide({16: {0: 0.96}, 32: {0: 0.97}}, {16: 2.0, 32: None}, {16: 1e4, 32: 2e4}, n_test=600)
    assert "no difference can be told from noise" in result.text
    assert result.recommended == 16  # 32 never reached the target


def test_paired_p_value_is_the_paired_t_test() -> None:
    from scipy.stats import t

    a, b = {0: 0.95, 1: 0.96, 2: 0.94, 3: 0.97}, {0: 0.93, 1: 0.95, 2: 0.935, 3: 0.94}
    diffs = [a[s] - b[s] for s in a]
    stat = statistics.fmean(diffs) / (statistics.stdev(diffs) / math.sqrt(len(diffs)))
    assert verdict.paired_p_value(a, b) == pytest.approx(2 * t.sf(abs(stat), len(diffs) - 1), rel=1e-12)
    assert math.isnan(verdict.paired_p_value({0: 0.9}, {0: 0.8}))  # one pair: no test


def test_holm_steps_down_and_stops_at_the_first_kept_hypothesis() -> None:
    # m = 4: thresholds 0.0125, 0.0167, 0.025, 0.05
    p = {(1, 2): 0.010, (1, 3): 0.016, (1, 4): 0.030, (2, 3): 0.020}
    assert verdict.holm(p) == set(p)  # 0.010, 0.016, 0.020, 0.030: each under its threshold
    p[(2, 3)] = 0.026
    assert verdict.holm(p) == {(1, 2), (1, 3)}  # 0.026 > 0.025 stops it: 0.030 is kept though < 0.05
    assert verdict.holm({(1, 2): 0.04}) == {(1, 2)} and verdict.holm({(1, 2): math.nan}) == set()


def test_indistinguishable_batch_sizes_are_almost_never_called_worse() -> None:
    """200 simulated studies, 6 batch sizes x 3 seeds with no true difference (a shared seed
    effect plus noise at the default study's spread): at least 95% call none worse."""
    rng = random.Random(0)
    batches, seeds, called = [16, 32, 64, 128, 256, 512], [0, 1, 2], 0
    for _ in range(200):
        seed_effect = {s: rng.gauss(0, 0.006) for s in seeds}
        f1 = {b: {s: 0.96 + seed_effect[s] + rng.gauss(0, 0.006) for s in seeds} for b in batches}
        result = verdict.decide(f1, dict.fromkeys(batches, 1.0), dict.fromkeys(batches, 1e4), n_test=600)
        called += len(result.tied) < len(batches)
    assert called <= 10, f"{called} of 200 null studies called a batch size worse"


def test_a_clear_drop_over_five_seeds_is_called_worse_despite_the_correction() -> None:
    rng = random.Random(1)
    drop = {16: 0.0, 32: 0.0, 64: -0.002, 128: -0.004, 256: -0.02, 512: -0.04}
    f1 = {b: {s: 0.96 + d + rng.gauss(0, 0.002) for s in range(5)} for b, d in drop.items()}
    result = verdict.decide(f1, dict.fromkeys(drop, 1.0), dict.fromkeys(drop, 1e4), n_test=600)
    assert {256, 512} <= set(drop) - set(result.tied)
    assert "Holm's correction over all 15 pairwise comparisons" in result.text
