"""The critical batch size, from the steps each batch size takes to reach one target val loss.

McCandlish, Kaplan et al. 2018 ("An Empirical Model of Large-Batch Training") find that the
steps S and examples E = S·B needed to reach a given loss trade off as
(S/S_min − 1)(E/E_min − 1) = 1. Rearranged, 1/S = 1/S_min − B_crit·(1/E), with
B_crit = E_min/S_min: a straight line of 1/S against 1/E, fitted by least squares.
Below B_crit doubling the batch halves the steps (perfect scaling); above it, the steps barely
fall while the examples (compute) grow (diminishing returns).
"""

from __future__ import annotations

import math
import random
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

TARGET_MARGIN = 0.02  # the auto target sits 2% above the worst experiment's best val loss
BOOTSTRAP_DRAWS = 1000
MIN_BATCH_SIZES = 3  # a line through two points always fits: R² would say nothing


def auto_target(curves: Sequence[Sequence[float]], margin: float = TARGET_MARGIN) -> float:
    """The val loss every experiment reaches: the highest of their lowest val losses, plus `margin`
    so the slowest experiment's step count is not set by where its curve happens to bottom out."""
    return max(min(curve) for curve in curves) * (1 + margin)


def first_reach(steps: Sequence[int], losses: Sequence[float], target: float) -> int | None:
    """The first scored step whose val loss is at or below `target`; None if it never is."""
    return next((s for s, loss in zip(steps, losses, strict=True) if loss <= target), None)


@dataclass(frozen=True)
class Fit:
    s_min: float  # the fewest steps to the target, at an infinite batch
    e_min: float  # the fewest examples to the target, at a batch of one
    b_crit: float  # E_min / S_min
    r2: float  # of the line 1/S = 1/S_min − B_crit/E through the batch sizes' mean steps
    batch_sizes: int  # how many batch sizes reached the target (the points of the fit)
    b_crit_low: float  # 95% bootstrap interval over seeds (NaN with one seed)
    b_crit_high: float

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
    is noise, not signal) and resampled for the interval; the bootstrap is seeded, so the same
    results give the same report."""
    by_batch: dict[int, list[int]] = defaultdict(list)
    for batch, steps in reached:
        if steps is not None:
            by_batch[batch].append(steps)
    if len(by_batch) < MIN_BATCH_SIZES:
        return NoFit(f"only {len(by_batch)} batch size(s) reached the target; the fit needs at least {MIN_BATCH_SIZES}")
    line = _line(_mean_steps(by_batch))
    if line is None:
        return NoFit("every batch size took the same examples to the target: nothing to fit")
    inverse_s_min, b_crit, r2 = line
    if inverse_s_min <= 0 or b_crit <= 0:
        return NoFit(
            "the steps to the target do not level off with batch size as the model predicts "
            f"(fitted 1/S_min = {inverse_s_min:.3g}, B_crit = {b_crit:.3g}): no critical batch size in this range"
        )
    low, high = _bootstrap(by_batch, seed)
    s_min = 1 / inverse_s_min
    return Fit(s_min, b_crit * s_min, b_crit, r2, len(by_batch), low, high)


def _bootstrap(by_batch: dict[int, list[int]], seed: int) -> tuple[float, float]:
    """2.5th and 97.5th percentiles of B_crit refitted to seeds resampled within each batch size."""
    if all(len(s) < 2 for s in by_batch.values()):
        return math.nan, math.nan
    rng = random.Random(seed)
    draws = []
    for _ in range(BOOTSTRAP_DRAWS):
        resampled = {b: rng.choices(s, k=len(s)) for b, s in by_batch.items()}
        line = _line(_mean_steps(resampled))
        if line is not None and line[0] > 0:
            draws.append(line[1])  # B_crit ≤ 0 draws count too: they widen the interval honestly
    if len(draws) < BOOTSTRAP_DRAWS // 2:
        return math.nan, math.nan
    draws.sort()
    return draws[int(0.025 * len(draws))], draws[min(len(draws) - 1, int(0.975 * len(draws)))]
