"""The critical batch size, from the steps each batch size takes to reach one target val loss.

McCandlish, Kaplan et al. 2018 ("An Empirical Model of Large-Batch Training") find that the
steps S and examples E = S·B needed to reach a given loss trade off as
(S/S_min − 1)(E/E_min − 1) = 1. Rearranged, 1/S = 1/S_min − B_crit·(1/E), with
B_crit = E_min/S_min: a straight line of 1/S against 1/E, fitted by least squares.
Below B_crit doubling the batch halves the steps (perfect scaling); above it, the steps barely
fall while the examples (compute) grow (diminishing returns).

The 95% interval propagates each batch size's own uncertainty: its mean steps are drawn from
mean + t·s/√n (Student's t with n − 1 degrees of freedom over its n seeds: the interval of a mean
from n values) and the line is refitted to every draw. Resampling the seeds instead (the
bootstrap) covered the true B_crit in only 80% of simulated 3-seed studies at the default
study's spread: a bootstrap of 3 values under-states their spread by (n − 1)/n and cannot draw
a value outside them. This one covered it in 93% (3 seeds) and 96% (5 seeds) of 400 simulated
studies (tests/test_critical.py checks at least 93% in 200).

Beside the McCandlish fit, the 20%-excess critical batch size (Zhang et al., ICLR 2025, "How
Does Critical Batch Size Scale in Pre-training?"): the batch at which the steps to the target
exceed perfect scaling from the smallest batch size by 20%, read from the same points.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

TARGET_MARGIN = 0.02  # the auto target sits 2% above the worst experiment's best val loss
INTERVAL_DRAWS = 1000
EXCESS = 0.2  # the 20%-excess critical batch size
MIN_BATCH_SIZES = 3  # a line through two points always fits: R² would say nothing


def auto_target(curves: Sequence[Sequence[float]], margin: float = TARGET_MARGIN) -> float:
    """The val loss every experiment reaches: the highest of their lowest val losses, plus `margin`
    so the slowest experiment's step count is not set by where its curve happens to bottom out."""
    return max(min(curve) for curve in curves) * (1 + margin)


def first_reach(steps: Sequence[int], losses: Sequence[float], target: float) -> int | None:
    """The first scored step whose val loss is at or below `target`; None if it never is (its
    weights are the ones kept and probed: the readings and exact values at the target are there)."""
    return next((s for s, loss in zip(steps, losses, strict=True) if loss <= target), None)


def crossing(xs: Sequence[float], losses: Sequence[float], at: int, target: float) -> float:
    """Where the val loss crosses `target` on the axis `xs` (steps, examples), `at` the first
    scored point at or below it: linear between it and the point before (the first point itself
    when it is already there). The first scored point alone is late by up to one scoring interval,
    and the rows' intervals differ (an adaptive row is scored as often as the largest batch's), so
    every row is read at its crossing."""
    if at == 0:
        return float(xs[0])
    share = (losses[at - 1] - target) / (losses[at - 1] - losses[at])  # in [0, 1): above, then at or below
    return xs[at - 1] + share * (xs[at] - xs[at - 1])


@dataclass(frozen=True)
class Fit:
    s_min: float  # the fewest steps to the target, at an infinite batch
    e_min: float  # the fewest examples to the target, at a batch of one
    b_crit: float  # E_min / S_min
    r2: float  # of the line 1/S = 1/S_min − B_crit/E through the batch sizes' mean steps
    batch_sizes: int  # how many batch sizes reached the target (the points of the fit)
    b_crit_low: float  # 95% interval from the seeds' Student-t uncertainty (NaN with one seed)
    b_crit_high: float
    # the batch whose steps exceed perfect scaling from the smallest batch by 20% (NaN: not within
    # the measured range), and its 95% interval by the same draws
    b_excess: float = math.nan
    b_excess_low: float = math.nan
    b_excess_high: float = math.nan

    def steps_at(self, batch: float) -> float:
        """The fitted hyperbola: S = S_min·(1 + B_crit/B)."""
        return self.s_min * (1 + self.b_crit / batch)


@dataclass(frozen=True)
class NoFit:
    reason: str


def _line(points: Sequence[tuple[int, float]]) -> tuple[float, float, float] | None:
    """(1/S_min, B_crit, R²) of the least-squares line of 1/S on 1/E through (batch, mean steps)."""
    xs = [1 / (steps * batch) for batch, steps in points]
    ys = [1 / steps for _, steps in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = my - slope * mx
    residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    r2 = 1 - residual / syy if syy > 0 else 1.0
    return intercept, -slope, r2


def _mean_steps(by_batch: dict[int, list[int]]) -> list[tuple[int, float]]:
    return [(b, statistics.fmean(s)) for b, s in sorted(by_batch.items())]


def fit(reached: Sequence[tuple[int, int | None]], seed: int = 0) -> Fit | NoFit:
    """Fit the S/E trade-off to (batch size, steps to target) pairs, one per experiment (None:
    never reached). Seeds are averaged per batch size before the fit (the seed-to-seed spread
    is noise, not signal); their spread gives the interval's draws, which are seeded, so the same
    results give the same report."""
    by_batch: dict[int, list[int]] = defaultdict(list)
    for batch, steps in reached:
        if steps is not None:
            by_batch[batch].append(steps)
    if len(by_batch) < MIN_BATCH_SIZES:
        return NoFit(f"only {len(by_batch)} batch size(s) reached the target; the fit needs at least {MIN_BATCH_SIZES}")
    points = _mean_steps(by_batch)
    line = _line(points)
    if line is None:
        return NoFit("every batch size took the same examples to the target: nothing to fit")
    inverse_s_min, b_crit, r2 = line
    if inverse_s_min <= 0 or b_crit <= 0:
        return NoFit(
            "the steps to the target do not level off with batch size as the model predicts "
            f"(fitted 1/S_min = {inverse_s_min:.3g}, B_crit = {b_crit:.3g}): no critical batch size in this range"
        )
    s_min = 1 / inverse_s_min
    b_crit_draws, excess_draws = _draws(by_batch, seed)
    low, high = _percentiles(b_crit_draws)
    excess_low, excess_high = _percentiles(excess_draws)
    return Fit(
        s_min, b_crit * s_min, b_crit, r2, len(by_batch), low, high, excess_batch(points), excess_low, excess_high
    )


def excess_batch(points: Sequence[tuple[int, float]], excess: float = EXCESS) -> float:
    """The batch at which the steps S(B) exceed perfect scaling from the smallest batch B0,
    S(B0)·B0/B, by `excess`: where S(B)·B / (S(B0)·B0) first reaches 1 + excess, interpolated
    linearly in B between the two batch sizes around it (exact on the hyperbola, where the ratio
    is (B + B_crit)/(B0 + B_crit)); NaN when no measured batch size reaches it."""
    (b0, s0), *rest = sorted(points)
    previous_b, previous_ratio = float(b0), 1.0
    for batch, steps in rest:
        ratio = steps * batch / (s0 * b0)
        if ratio >= 1 + excess:
            share = (1 + excess - previous_ratio) / (ratio - previous_ratio) if ratio > previous_ratio else 1.0
            return previous_b + max(0.0, share) * (batch - previous_b)
        previous_b, previous_ratio = float(batch), ratio
    return math.nan


def _draws(by_batch: dict[int, list[int]], seed: int) -> tuple[list[float], list[float]]:
    """B_crit and the 20%-excess batch refitted to INTERVAL_DRAWS draws of every batch size's mean
    steps from mean + t·s/√n (Student's t, n − 1 degrees of freedom); none with one seed."""
    if any(len(s) < 2 for s in by_batch.values()):
        return [], []
    rng = random.Random(seed)
    spread = {
        b: (statistics.fmean(s), statistics.stdev(s) / math.sqrt(len(s)), len(s) - 1) for b, s in by_batch.items()
    }
    b_crits, excesses = [], []
    for _ in range(INTERVAL_DRAWS):
        points = [(b, max(1.0, mean + se * _student_t(rng, df))) for b, (mean, se, df) in sorted(spread.items())]
        line = _line(points)
        if line is not None and line[0] > 0:
            b_crits.append(line[1])  # B_crit ≤ 0 draws count too: they widen the interval honestly
        excesses.append(excess_batch(points))
    return b_crits, excesses


def _student_t(rng: random.Random, df: int) -> float:
    """A draw of Student's t with `df` degrees of freedom: a normal over the root of a chi-square/df."""
    return rng.gauss(0.0, 1.0) / math.sqrt(rng.gammavariate(df / 2, 2.0) / df)


def _percentiles(draws: list[float]) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles; NaN unless at least half the draws gave a value (a draw
    whose value is outside the measured range counts as +inf: it widens the interval upward)."""
    finite = sorted(math.inf if math.isnan(d) else d for d in draws)
    if len([d for d in finite if math.isfinite(d)]) < INTERVAL_DRAWS // 2:
        return math.nan, math.nan
    return finite[int(0.025 * len(finite))], finite[min(len(finite) - 1, int(0.975 * len(finite)))]
