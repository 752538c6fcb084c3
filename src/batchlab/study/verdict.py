"""Which batch size to use: never "best" on a difference inside the seed-to-seed noise.

Every figure is a mean with a 95% confidence interval (Student's t over seeds). A batch size is
"measurably worse" than the best one when the paired t-test by seed (the same seed gives the
same initial weights) rejects equality under Holm's step-down correction over every pairwise
comparison of the study's batch sizes, at a 5% family-wise error. The family is every pair, not
only the comparisons with the best, because the best is itself chosen from the same numbers:
with 6 batch sizes, 3 seeds and no true difference, Holm over the 5 comparisons with the best
still called one of them worse in 7.3% of simulated studies; over all 15 pairs, in 2.6%. The
recommendation is the fastest to the target among those not measurably worse than the best.
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


@dataclass(frozen=True)
class Verdict:
    best: int  # highest mean test F1
    tied: list[int]  # not measurably worse than `best` (`best` included)
    recommended: int  # the fastest to the target among `tied`
    text: str
    why: str = ""  # what made `recommended` the pick, as a phrase ("the fastest to the target val loss (…)")


def decide(
    f1: Mapping[int, Mapping[int, float]],
    seconds_to_target: Mapping[int, float | None],
    samples_per_s: Mapping[int, float],
    n_test: int,
) -> Verdict:
    """`f1[batch][seed]` test F1; `seconds_to_target[batch]` mean training seconds to the target
    val loss (None: not reached); `n_test` rows in the test split."""
    means = {b: statistics.fmean(by_seed.values()) for b, by_seed in f1.items()}
    best = max(means, key=lambda b: means[b])
    seeds = min(len(by_seed) for by_seed in f1.values())
    batches = sorted(f1)
    pairs = [(a, b) for i, a in enumerate(batches) for b in batches[i + 1 :]]
    rejected = holm({(a, b): paired_p_value(f1[a], f1[b]) for a, b in pairs})
    worse = [b for b in batches if b != best and tuple(sorted((b, best))) in rejected and means[b] < means[best]]
    tied = [b for b in batches if b not in worse]
    reached = {b: s for b in tied if (s := seconds_to_target.get(b)) is not None}
    if reached:
        recommended = min(reached, key=lambda b: reached[b])
        why = f"the fastest to the target val loss ({reached[recommended]:.2f} s of training)"
    else:
        recommended = max(tied, key=lambda b: samples_per_s[b])
        why = "the highest throughput (none of them reached the target)"
    lines = [
        f"Test split: {n_test} rows, so one example moves accuracy by {100 / n_test:.2f} points.",
        f"Highest mean test F1: batch {best} ({means[best]:.4f}).",
    ]
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
        if worse:
            lines.append(
                f"Not measurably worse than batch {best} ({test}): {', '.join(map(str, tied))}. "
                f"Measurably worse: {', '.join(map(str, worse))}."
            )
        else:
            lines.append(f"No batch size is measurably worse than batch {best} ({test}).")
    lines.append(f"Recommended: batch {recommended}, {why} among those.")
    return Verdict(best, tied, recommended, " ".join(lines), why)
