"""Which batch size to use: never "best" on a difference inside the seed-to-seed noise.

Every figure is a mean with a 95% confidence interval (Student's t over seeds). Batch sizes are
compared with the best one paired by seed (the same seed gives the same initial weights), and
the recommendation is the fastest to the target among those not measurably worse than the best.
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


def paired_difference(a: Mapping[int, float], b: Mapping[int, float]) -> tuple[float, float, int]:
    """Mean of a − b over the seeds both have, its 95% CI half-width, and the number of pairs."""
    seeds = sorted(set(a) & set(b))
    mean, half = mean_ci([a[s] - b[s] for s in seeds])
    return mean, half, len(seeds)


@dataclass(frozen=True)
class Verdict:
    best: int  # highest mean test F1
    tied: list[int]  # not measurably worse than `best` (`best` included)
    recommended: int  # the fastest to the target among `tied`
    text: str


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
    worse: list[int] = []
    tied = [best]
    for batch in sorted(f1):
        if batch == best:
            continue
        diff, half, pairs = paired_difference(f1[batch], f1[best])
        # measurably worse: the whole 95% interval of the paired difference lies below zero
        (worse if pairs >= 2 and diff + half < 0 else tied).append(batch)
    tied.sort()
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
    elif worse:
        lines.append(
            f"Not measurably worse (paired by seed over {seeds} seeds, 95% CI of the F1 difference "
            f"includes 0): {', '.join(map(str, tied))}. Measurably worse: {', '.join(map(str, worse))}."
        )
    else:
        lines.append(f"No batch size is measurably worse than batch {best} (paired by seed over {seeds} seeds).")
    lines.append(f"Recommended: batch {recommended}, {why} among those.")
    return Verdict(best, tied, recommended, " ".join(lines))
