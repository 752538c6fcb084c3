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
    assert result.best == 32 and result.candidates == [16, 32, 64]
    assert result.recommended == 64  # the fastest to the target among those that cannot be told apart
    assert "No batch size beats another measurably" in result.text and "600 rows" in result.text


def test_an_exact_tie_in_f1_goes_to_the_smallest_batch_whatever_order_the_rows_arrive_in() -> None:
    # a study's rows arrive in its folders' order (bs128 before bs16); the transformer example scores
    # the same F1 on every seed at several batch sizes
    same = {0: 0.9913372662144719, 1: 0.9913372662144719, 2: 0.9913372662144719}
    f1 = {128: dict(same), 16: dict(same), 256: {0: 0.95, 1: 0.951, 2: 0.949}, 32: dict(same)}
    result = verdict.decide(f1, {16: 2.0, 32: 1.0, 128: 1.5, 256: 1.2}, {b: 1e4 * b for b in f1}, n_test=600)
    assert result.best == 16 and result.recommended == 32
    assert "Highest mean test F1: batch 16 (0.9913), tied exactly with 32, 128." in result.text
    assert result.f1_diff[0] == 0.0 and result.speedup == 2.0


def test_consistently_worse_batch_is_excluded_from_the_recommendation() -> None:
    f1 = {16: {0: 0.96, 1: 0.961, 2: 0.962}, 512: {0: 0.90, 1: 0.905, 2: 0.899}}
    result = verdict.decide(f1, {16: 5.0, 512: 0.5}, {16: 1e4, 512: 9e4}, n_test=600)
    assert result.candidates == [16] and result.recommended == 16
    assert "Holm's correction over all 1 pairwise comparisons at 5% family-wise error): 512 by 16." in result.text


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
        called += len(result.candidates) < len(batches)
    assert called <= 10, f"{called} of 200 null studies called a batch size worse"


def test_a_clear_drop_over_five_seeds_is_called_worse_despite_the_correction() -> None:
    rng = random.Random(1)
    drop = {16: 0.0, 32: 0.0, 64: -0.002, 128: -0.004, 256: -0.02, 512: -0.04}
    f1 = {b: {s: 0.96 + d + rng.gauss(0, 0.002) for s in range(5)} for b, d in drop.items()}
    result = verdict.decide(f1, dict.fromkeys(drop, 1.0), dict.fromkeys(drop, 1e4), n_test=600)
    assert {256, 512} <= set(drop) - set(result.candidates)
    assert "Holm's correction over all 15 pairwise comparisons" in result.text


def _holm_adjusted(p: dict[tuple[int, int], float], alpha: float = 0.05) -> set[tuple[int, int]]:
    """Holm by adjusted p-values (max over the running (m − j)·p), written apart from verdict.holm."""
    ordered = sorted(p, key=lambda k: p[k])
    adjusted, running = {}, 0.0
    for j, key in enumerate(ordered):
        running = max(running, min(1.0, (len(p) - j) * p[key]))
        adjusted[key] = running
    return {k for k, a in adjusted.items() if a <= alpha}


def _scipy_verdict(f1: dict[int, dict[int, float]]) -> tuple[set[int], dict[tuple[int, int], float]]:
    """The batch sizes some other beats measurably, and every pair's p-value, from scipy alone."""
    from scipy.stats import ttest_rel

    batches = sorted(f1)
    p = {(a, b): float(ttest_rel([f1[a][s] for s in sorted(f1[a])], [f1[b][s] for s in sorted(f1[a])]).pvalue)
         for i, a in enumerate(batches) for b in batches[i + 1 :]}  # fmt: skip
    mean = {b: statistics.fmean(v.values()) for b, v in f1.items()}
    beaten = {min(k, key=mean.__getitem__) for k in _holm_adjusted(p)}
    return beaten, p


def test_no_candidate_beats_the_recommendation_measurably() -> None:
    """The default study's shape (F1 falling with the batch, the fastest the largest): batch 256 is
    not measurably worse than the best but is than 16 and 64, so it is no candidate. Over 300
    simulated studies, scipy's paired tests with Holm (adjusted p-values) never find a batch size
    that beats the recommendation, and the candidates are exactly those none beats."""
    rng = random.Random(3)
    batches = [16, 32, 64, 128, 256, 512]
    drop = {16: 0.0, 32: 0.0005, 64: -0.002, 128: -0.005, 256: -0.011, 512: -0.017}
    seconds = {16: 0.17, 32: 0.09, 64: 0.06, 128: 0.045, 256: 0.04, 512: 0.041}
    excluded_fastest = 0
    for _ in range(300):
        seed_effect = {s: rng.gauss(0, 0.003) for s in range(5)}
        f1 = {b: {s: 0.964 + drop[b] + seed_effect[s] + rng.gauss(0, 0.003) for s in range(5)} for b in batches}
        result = verdict.decide(f1, seconds, dict.fromkeys(batches, 1e4), n_test=600)
        beaten, _ = _scipy_verdict(f1)
        assert result.recommended not in beaten
        assert result.candidates == [b for b in batches if b not in beaten]
        assert result.recommended == min(result.candidates, key=seconds.__getitem__)
        excluded_fastest += 256 in beaten and result.recommended != 256
    assert excluded_fastest > 30  # the rule bites: 256 would have been picked in those studies


def test_the_first_line_states_the_price_against_the_best_and_a_close_call() -> None:
    from scipy import stats

    # 32 is best; 128 trails it by 0.0036 on average, p = 0.057: kept, within 2x of its threshold 0.05
    f1 = {32: {0: 0.966, 1: 0.962, 2: 0.970, 3: 0.964, 4: 0.967},
          128: {0: 0.962, 1: 0.962, 2: 0.962, 3: 0.963, 4: 0.962},
          512: {0: 0.930, 1: 0.925, 2: 0.935, 3: 0.932, 4: 0.928}}  # fmt: skip
    seconds = {32: 0.09, 128: 0.04, 512: 0.03}
    result = verdict.decide(f1, seconds, {32: 1e4, 128: 4e4, 512: 9e4}, n_test=600)
    _, p = _scipy_verdict(f1)
    assert result.best == 32 and result.recommended == 128 and result.candidates == [32, 128]
    diffs = [f1[128][s] - f1[32][s] for s in range(5)]
    low, high = stats.t.interval(0.95, 4, loc=statistics.fmean(diffs), scale=stats.sem(diffs))
    assert result.f1_diff == (
        pytest.approx(statistics.fmean(diffs), rel=1e-12),
        pytest.approx((high - low) / 2, rel=1e-9),
    )
    assert result.speedup == pytest.approx(0.09 / 0.04)
    first = result.text.splitlines()[0]
    assert first.startswith("Recommended: batch 128, the fastest to the target val loss (0.04 s of training)")
    assert "2.2x faster to the target than batch 32, the highest in mean test F1 (0.09 s)" in first
    assert f"at a test F1 {result.f1_diff[0]:+.4f} ± {result.f1_diff[1]:.4f} against it" in first
    assert abs(result.f1_diff[0]) < result.f1_diff[1] and "clear of 0" not in first
    # Holm's thresholds for m = 3: the smallest p against 0.05/3, the next 0.05/2, the largest 0.05
    ranked = sorted(p.values())
    threshold = 0.05 / (3 - ranked.index(p[(32, 128)]))
    assert threshold / 2 <= p[(32, 128)] <= 2 * threshold  # the case this test is about: a close call
    assert f"close: 32 vs 128: p = {p[(32, 128)]:.4f} against its Holm threshold {threshold:.4f}, kept" in first


def test_a_recommendation_that_is_the_best_says_so_and_has_no_price() -> None:
    f1 = {16: {0: 0.96, 1: 0.961, 2: 0.962}, 512: {0: 0.90, 1: 0.905, 2: 0.899}}
    result = verdict.decide(f1, {16: 5.0, 512: 0.5}, {16: 1e4, 512: 9e4}, n_test=600)
    assert result.text.splitlines()[0].endswith("; it is also the highest in mean test F1.")


def test_an_interval_that_excludes_zero_before_the_correction_is_said_so() -> None:
    """128 trails 32 on every seed (p = 0.027, its 95% interval clear of 0) but Holm keeps it (its
    threshold at that rank is 0.025): a candidate, and the first line says both."""
    best = [0.966, 0.962, 0.970, 0.964, 0.967]

    def below(drops: list[float]) -> dict[int, float]:
        return {s: v - d for s, (v, d) in enumerate(zip(best, drops, strict=True))}

    f1 = {
        32: dict(enumerate(best)),
        128: below([0.005, 0.001, 0.008, 0.002, 0.006]),
        512: below([0.010, 0.011, 0.009, 0.012, 0.010]),
    }
    result = verdict.decide(f1, {32: 0.09, 128: 0.04, 512: 0.03}, {32: 1e4, 128: 4e4, 512: 9e4}, n_test=600)
    assert result.candidates == [32, 128] and result.recommended == 128
    diff, half = result.f1_diff
    assert abs(diff) > half
    first = result.text.splitlines()[0]
    assert "its interval clear of 0 on its own, before the correction for every pair" in first
    assert "close: 32 vs 128: p = 0.0" in first and ", kept" in first
