"""Which batch size to use: never "best" on a difference inside the seed-to-seed noise, and never
one that another candidate beats.

Every figure is a mean with a 95% confidence interval (Student's t over seeds). Batch size a
"beats b measurably" when a's mean test F1 is higher and the paired t-test by seed (the same
seed gives the same initial weights) rejects equality under Holm's step-down correction over
every pairwise comparison of the study's batch sizes, at a 5% family-wise error. The family is
every pair, not only the comparisons with the best, because the best is itself chosen from the
same numbers: with 6 batch sizes, 3 seeds and no true difference, Holm over the 5 comparisons
with the best still called one of them worse in 7.3% of simulated studies; over all 15 pairs, in
2.6%. The candidates are the batch sizes no other batch size beats measurably (the best always
is one); the recommendation is the fastest to the target among them, and its first line says
what it trades against the best-F1 batch: the speed-up, the F1 difference with its interval, and
any test that sits within a factor of two of its Holm threshold ("close").
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

CONFIDENCE = 0.95


def t_quantile(n: int) -> float:
    """The two-sided 95% Student's t factor for n values (n − 1 degrees of freedom)."""
    from scipy.stats import t  # scikit-learn's dependency; only the report needs it

    return float(t.ppf(0.5 + CONFIDENCE / 2, n - 1))


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% confidence interval (NaN with fewer than two values)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    return mean, t_quantile(len(values)) * statistics.stdev(values) / math.sqrt(len(values))


def paired_p_value(a: Mapping[int, float], b: Mapping[int, float]) -> float:
    """Two-sided p-value of the paired t-test of a against b over the seeds both have (scipy's
    ttest_rel); NaN with fewer than two pairs or when every pair differs by the same amount."""
    from scipy.stats import ttest_rel

    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return math.nan
    diffs = [a[s] - b[s] for s in seeds]
    if max(diffs) == min(diffs):  # no spread: the t statistic is undefined (0/0) or infinite
        return math.nan if diffs[0] == 0 else 0.0
    return float(ttest_rel([a[s] for s in seeds], [b[s] for s in seeds]).pvalue)


def holm(p_values: Mapping[tuple[int, int], float], alpha: float = 1 - CONFIDENCE) -> set[tuple[int, int]]:
    """The hypotheses Holm's step-down procedure rejects at family-wise error `alpha`: the k-th
    smallest p-value (k from 0) is compared with alpha / (m − k), stopping at the first that is
    not below it. NaN p-values count in m and are never rejected."""
    m = len(p_values)
    ordered = sorted((p, key) for key, p in p_values.items() if not math.isnan(p))
    rejected: set[tuple[int, int]] = set()
    for k, (p, key) in enumerate(ordered):
        if p > alpha / (m - k):
            break
        rejected.add(key)
    return rejected


def holm_thresholds(
    p_values: Mapping[tuple[int, int], float], alpha: float = 1 - CONFIDENCE
) -> dict[tuple[int, int], float]:
    """The threshold each p-value meets in Holm's procedure: alpha / (m − k) at its rank k (from
    0, smallest first); NaN for a NaN p-value, which has no rank."""
    m = len(p_values)
    ordered = sorted((p, key) for key, p in p_values.items() if not math.isnan(p))
    out = {key: math.nan for key in p_values}
    out.update({key: alpha / (m - k) for k, (_, key) in enumerate(ordered)})
    return out


def paired_difference(a: Mapping[int, float], b: Mapping[int, float]) -> tuple[float, float]:
    """a − b over the seeds both have: the mean paired difference and its 95% half-width."""
    seeds = sorted(set(a) & set(b))
    return mean_ci([a[s] - b[s] for s in seeds])


@dataclass(frozen=True)
class Pair:
    """One comparison of the family, ordered so that `higher` has the higher mean test F1."""

    higher: int
    lower: int
    diff: float  # mean paired F1 difference, higher − lower (≥ 0)
    half: float  # its 95% half-width (NaN with one seed)
    p: float  # the paired t-test's two-sided p-value (NaN: no test)
    threshold: float  # Holm's threshold at this p-value's rank
    beats: bool  # Holm rejects equality: `higher` beats `lower` measurably

    @property
    def close(self) -> bool:
        """Within a factor of two of its threshold, on either side: a knife edge worth saying."""
        return math.isfinite(self.p) and self.threshold / 2 <= self.p <= 2 * self.threshold

    def says(self) -> str:
        side = "rejected" if self.beats else "kept"
        return (
            f"{self.higher} vs {self.lower}: p = {self.p:.4f} against its Holm threshold {self.threshold:.4f}, {side}"
        )


@dataclass(frozen=True)
class Verdict:
    best: int  # highest mean test F1
    candidates: list[int]  # the batch sizes no other batch size beats measurably (`best` included)
    recommended: int  # the fastest to the target among `candidates`
    text: str  # the first line is the recommendation and its price
    why: str = ""  # what made `recommended` the pick, as a phrase ("the fastest to the target val loss (…)")
    pairs: tuple[Pair, ...] = ()  # every comparison of the family
    speedup: float = math.nan  # best's seconds to the target / recommended's (throughput when none reached it)
    f1_diff: tuple[float, float] = (0.0, math.nan)  # recommended − best: mean paired difference, 95% half-width

    @property
    def first_line(self) -> str:
        return self.text.split("\n", 1)[0]

    def beaten_by(self, batch: int) -> list[int]:
        return sorted(p.higher for p in self.pairs if p.lower == batch and p.beats)


def decide(
    f1: Mapping[int, Mapping[int, float]],
    seconds_to_target: Mapping[int, float | None],
    samples_per_s: Mapping[int, float],
    n_test: int,
) -> Verdict:
    """`f1[batch][seed]` test F1; `seconds_to_target[batch]` mean training seconds to the target
    val loss (None: not reached); `n_test` rows in the test split."""
    batches = sorted(f1)
    # an exact tie goes to the smallest batch (the most updates), not to the order the rows arrived in
    means = {b: statistics.fmean(f1[b].values()) for b in batches}
    best = max(means, key=lambda b: means[b])
    tied = [b for b in batches if b != best and means[b] == means[best]]
    seeds = min(len(by_seed) for by_seed in f1.values())
    keys = [(a, b) for i, a in enumerate(batches) for b in batches[i + 1 :]]
    p_values = {(a, b): paired_p_value(f1[a], f1[b]) for a, b in keys}
    rejected, thresholds = holm(p_values), holm_thresholds(p_values)
    pairs = []
    for a, b in keys:
        hi, lo = (a, b) if means[a] >= means[b] else (b, a)
        diff, half = paired_difference(f1[hi], f1[lo])
        pairs.append(Pair(hi, lo, diff, half, p_values[a, b], thresholds[a, b], (a, b) in rejected))
    beaten = {p.lower for p in pairs if p.beats}
    candidates = [b for b in batches if b not in beaten]
    reached = {b: s for b in candidates if (s := seconds_to_target.get(b)) is not None}
    if reached:
        recommended = min(reached, key=lambda b: reached[b])
        why = f"the fastest to the target val loss ({reached[recommended]:.2f} s of training)"
        best_s = seconds_to_target.get(best)
        speedup = best_s / reached[recommended] if best_s is not None and reached[recommended] > 0 else math.nan
    else:
        recommended = max(candidates, key=lambda b: samples_per_s[b])
        why = "the highest throughput (none of them reached the target)"
        speedup = samples_per_s[recommended] / samples_per_s[best]
    f1_diff = paired_difference(f1[recommended], f1[best])
    verdict = Verdict(best, candidates, recommended, "", why, tuple(pairs), speedup, f1_diff)
    lines = [_first_line(verdict, seconds_to_target, bool(reached))]
    lines.append(
        f"Test split: {n_test} rows, so one example moves accuracy by {100 / n_test:.2f} points. "
        f"Highest mean test F1: batch {best} ({means[best]:.4f})"
        + (f", tied exactly with {_listed(tied)}." if tied else ".")
    )
    if seeds < 2:
        lines.append(
            "One seed per batch size: no difference can be told from noise. Set sweep.seeds to 3 or more "
            "before trusting any ranking."
        )
    else:
        test = (
            f"paired t-tests by seed over {seeds} seeds, Holm's correction over all {len(pairs)} pairwise "
            f"comparisons at 5% family-wise error"
        )
        if beaten:
            by = "; ".join(f"{b} by {', '.join(map(str, verdict.beaten_by(b)))}" for b in sorted(beaten))
            lines.append(
                f"Beaten measurably ({test}): {by}. No batch size beats {_listed(candidates)}: the candidates."
            )
        else:
            lines.append(f"No batch size beats another measurably ({test}): every one is a candidate.")
    return Verdict(best, candidates, recommended, "\n".join(lines), why, tuple(pairs), speedup, f1_diff)


def _listed(batches: Sequence[int]) -> str:
    return ", ".join(map(str, batches))


def _first_line(verdict: Verdict, seconds_to_target: Mapping[int, float | None], reached: bool) -> str:
    """The recommendation and its price against the best-F1 batch, with any close call."""
    rec, best = verdict.recommended, verdict.best
    head = f"Recommended: batch {rec}, {verdict.why} among the batch sizes no other beats measurably in test F1"
    if rec == best:
        return head + "; it is also the highest in mean test F1."
    diff, half = verdict.f1_diff
    interval = f"{diff:+.4f} ± {half:.4f}" if math.isfinite(half) else f"{diff:+.4f} (one seed: no interval)"
    best_s = seconds_to_target.get(best)
    if not reached:
        speed = f"{verdict.speedup:.1f}x the samples/s of batch {best}, the highest in mean test F1"
    elif best_s is None:
        speed = f"batch {best}, the highest in mean test F1, did not reach the target on every seed"
    else:
        speed = f"{verdict.speedup:.1f}x faster to the target than batch {best}, the highest in mean test F1"
        speed += f" ({best_s:.2f} s)"
    line = f"{head}: {speed}, at a test F1 {interval} against it (paired by seed)"
    if math.isfinite(half) and abs(diff) > half:  # said, lest the interval read as a contradiction
        line += ", its interval clear of 0 on its own, before the correction for every pair"
    close = [p for p in verdict.pairs if p.lower == rec and p.close]
    if close:
        line += "; close: " + "; ".join(p.says() for p in close) + " (within 2x of it)"
    return line + "."
