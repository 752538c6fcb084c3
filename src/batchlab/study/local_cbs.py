"""The local critical batch size: how large a batch a run can take at a point of its training,
measured by branching (sweep.local_cbs; Merrill et al. 2025, "Critical Batch Size Revisited").

From the run's checkpoint at a point, each seed trains one branch per multiplier k on the same
examples, at batch k·B (B: the run's, train.batch_size) with the lr scaled by sweep.lr_scaling,
and its val loss is read after them. The base branch (k = 1) falls from the point's val loss L₀
to L(1) over those examples. A batch k·B is **within** the critical batch size when its branch
keeps at least 1 − τ of that fall (τ: sweep.local_cbs_tolerance), i.e. when the expected shortfall

    d(k) = L(k) − L(1) − τ·(L₀ − L(1))

is ≤ 0, and the local critical batch size is the largest k·B of the grid before the first k whose
expected shortfall is > 0. (Merrill et al. allow a fixed 0.01 of loss; a share of the base branch's
own progress does not depend on the loss's scale or on how far training is. A "not measurably
worse" rule with no tolerance has no fixed answer: its answer grows with the seeds, which is why
the tolerance is kept and tested both ways.)

Each seed gives d_s(k), paired (the same start, examples and masks for every k). Two families of
one-sided t-tests over the multipliers k > 1, each with Holm's correction at α/2:
- **worse**: H₀ d(k) ≤ 0 against d(k) > 0; the interval's upper end is the multiplier before the
  first k measurably worse (the largest k when none is);
- **within**: H₀ d(k) ≥ 0 against d(k) < 0; the lower end is the largest k such that every
  multiplier up to it is measurably within (k = 1 always is).
The true value is below the lower end only if the "within" family rejects a true H₀, and above
the upper end only if the "worse" family does: each at most α/2 by Holm, so the interval [low,
high] covers it with probability ≥ 1 − α (tests/study/test_local_cbs.py checks it in simulation).
The estimate is the largest k before the first whose mean shortfall is > 0; it lies in the interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from batchlab.study.verdict import holm

ALPHA = 0.05  # the interval's error, split evenly between its two ends


@dataclass(frozen=True)
class Estimate:
    """The local critical batch multiplier at one point, with its interval and what decided it."""

    multiplier: int  # one of the grid's; meaningless where not `measured`
    low: int
    high: int
    multipliers: list[int]
    shortfall: list[float]  # the mean d(k) over seeds, by multiplier (0 for k = 1 by construction: -τ·progress)
    p_worse: list[float]  # one-sided p-values of "worse", by multiplier (NaN for k = 1)
    p_within: list[float]  # one-sided p-values of "within", by multiplier (NaN for k = 1)
    worse: list[bool]  # rejected by Holm: measurably worse than the tolerance
    within: list[bool]  # rejected by Holm: measurably within it (True for k = 1)
    progress: float  # the base branch's mean fall in val loss, L₀ − L(1)
    measured: bool = True  # False: the base branch made no progress, so no tolerance is defined

    @property
    def spans_grid(self) -> bool:
        """The interval runs from the first multiplier to the last: the seeds cannot tell."""
        return self.low == self.multipliers[0] and self.high == self.multipliers[-1]


def _one_sided(values: list[float], alternative: str) -> float:
    """The one-sample t-test of mean 0, one-sided (scipy's ttest_1samp's p-value, from Student's t
    distribution directly: the simulation tests call this thousands of times); NaN with one value
    or no spread."""
    from scipy.special import stdtr

    n = len(values)
    if n < 2 or max(values) == min(values):
        return math.nan
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    t = mean / (sd / math.sqrt(n))
    return float(stdtr(n - 1, -t if alternative == "greater" else t))


def estimate(
    start: list[float], losses: list[list[float]], multipliers: list[int], tolerance: float, alpha: float = ALPHA
) -> Estimate:
    """The local critical batch multiplier from each seed's val loss at the point (`start`) and
    after each branch (`losses[seed][i]`, in the order of `multipliers`, which hold 1)."""
    order = sorted(range(len(multipliers)), key=lambda i: multipliers[i])
    ks = [multipliers[i] for i in order]
    if ks[0] != 1:
        raise ValueError(f"the multipliers must include 1, the base branch; got {multipliers}")
    rows = [[seed_losses[i] for i in order] for seed_losses in losses]
    if len(rows) != len(start) or any(len(r) != len(ks) for r in rows):
        raise ValueError("one start loss per seed and one loss per multiplier for each seed")
    progress = [s - r[0] for s, r in zip(start, rows, strict=True)]
    d = [[r[j] - r[0] - tolerance * p for r, p in zip(rows, progress, strict=True)] for j in range(len(ks))]
    shortfall = [sum(v) / len(v) for v in d]
    p_worse = [math.nan] + [_one_sided(d[j], "greater") for j in range(1, len(ks))]
    p_within = [math.nan] + [_one_sided(d[j], "less") for j in range(1, len(ks))]
    worse_set = holm({(j, 0): p_worse[j] for j in range(1, len(ks))}, alpha / 2)
    within_set = holm({(j, 0): p_within[j] for j in range(1, len(ks))}, alpha / 2)
    worse = [False] + [(j, 0) in worse_set for j in range(1, len(ks))]
    within = [True] + [(j, 0) in within_set for j in range(1, len(ks))]
    mean_progress = sum(progress) / len(progress)
    first_worse = next((j for j in range(1, len(ks)) if worse[j]), len(ks))
    last_within = next((j - 1 for j in range(1, len(ks)) if not within[j]), len(ks) - 1)
    first_over = next((j for j in range(1, len(ks)) if shortfall[j] > 0), len(ks))
    return Estimate(ks[first_over - 1], ks[last_within], ks[first_worse - 1], ks, shortfall, p_worse, p_within, worse,
                    within, mean_progress, measured=mean_progress > 0)


@dataclass(frozen=True)
class Point:
    """One branch point of the run: where, what the branches read, and the noise scale there."""

    epoch: int  # the checkpoint's epoch (the branches start after it)
    fraction: float  # of the run's examples
    examples: int  # examples the run had seen there
    batch: int  # the run's batch B: the branches' are k·B
    start: list[float]  # each seed's val loss at the point
    losses: list[list[float]]  # [seed][multiplier]: val loss after each branch
    b_simple_exact: float  # the exact B_simple at the point's weights (mean over seeds; NaN: not computed)
    b_simple_estimate: float  # the run's in-training reading there (mean over seeds; NaN: none yet)
    result: Estimate

    def bounds(self) -> tuple[float, float]:
        """The interval in rows, off the grid: a lower end at the run's own batch (k = 1 is within by
        definition) says nothing, so 0; an upper end below the next multiplier (measurably worse),
        or unbounded (∞) at the grid's last."""
        r, b = self.result, self.batch
        low = r.low * b if r.low > r.multipliers[0] else 0.0
        up = r.multipliers.index(r.high) + 1
        return low, (r.multipliers[up] * b if up < len(r.multipliers) else math.inf)

    def figures(self) -> dict[str, float]:
        """The point's figures in rows (k·B): the estimate and its interval on the grid, the noise
        scale there, and the ratio CBS / exact B_simple with its interval off the grid (`bounds`)."""
        r, b, exact = self.result, self.batch, self.b_simple_exact
        out = {"fraction": self.fraction, "epoch": float(self.epoch), "examples": float(self.examples),
               "b_simple_exact": exact, "b_simple_estimate": self.b_simple_estimate}
        if not r.measured:
            return out
        out.update(cbs=float(r.multiplier * b), cbs_low=float(r.low * b), cbs_high=float(r.high * b))
        if exact == exact and exact > 0:
            low, high = self.bounds()
            out.update(ratio_to_exact=r.multiplier * b / exact, ratio_low=low / exact, ratio_high=high / exact)
        return out


def points_of(raw: list[dict[str, Any]], tolerance: float) -> list[Point]:
    """The points from the branches' rows (sweep/branches.py), each with its estimate."""
    out = []
    for p in raw:
        result = estimate(p["start"], p["losses"], p["multipliers"], tolerance)
        out.append(Point(p["epoch"], p["fraction"], p["examples"], p["batch"], p["start"], p["losses"],
                         p["b_simple_exact"], p["b_simple_estimate"], result))
    return out


def figures(points: list[Point], b_crit: tuple[float, float, float] | None) -> dict[str, float | str]:
    """sweep.json's local_cbs.* figures: each point's, keyed by its share of the run (local_cbs.p25.cbs),
    the time-average of CBS(t) (geometric, over the measured points) and whether it falls inside the
    global B_crit interval (`b_crit`: estimate, low, high)."""
    out: dict[str, float | str] = {}
    for p in points:
        name = f"local_cbs.p{round(p.fraction * 100)}"  # finite figures only: sweep.json is JSON
        out.update({f"{name}.{k}": v for k, v in p.figures().items() if k != "fraction" and math.isfinite(v)})
    measured = [p.result.multiplier * p.batch for p in points if p.result.measured]
    if measured:
        mean = math.exp(sum(math.log(c) for c in measured) / len(measured))
        out["local_cbs.mean"] = mean
        if b_crit is not None and all(v == v for v in b_crit):
            out["local_cbs.mean_in_b_crit_interval"] = "yes" if b_crit[1] <= mean <= b_crit[2] else "no"
    return out


COLUMNS = ("fraction", "epoch", "batch", "multiplier", "mean_val_loss", "mean_start_val_loss", "shortfall",
           "p_worse", "p_within", "worse", "within", "cbs", "cbs_low", "cbs_high", "b_simple_exact",
           "b_simple_estimate")


def rows(points: list[Point]) -> list[dict[str, Any]]:
    """local_cbs.csv: one row per point and multiplier, the seeds' mean loss and what the tests read
    (the losses are stored in the multipliers' order, which the config sorts)."""
    out = []
    for p in points:
        r = p.result
        for j, k in enumerate(r.multipliers):
            out.append({"fraction": p.fraction, "epoch": p.epoch, "batch": k * p.batch, "multiplier": k,
                        "mean_val_loss": sum(s[j] for s in p.losses) / len(p.losses),
                        "mean_start_val_loss": sum(p.start) / len(p.start), "shortfall": r.shortfall[j],
                        "p_worse": r.p_worse[j], "p_within": r.p_within[j], "worse": r.worse[j],
                        "within": r.within[j], "cbs": r.multiplier * p.batch, "cbs_low": r.low * p.batch,
                        "cbs_high": r.high * p.batch, "b_simple_exact": p.b_simple_exact,
                        "b_simple_estimate": p.b_simple_estimate})
    return out


def schedule(points: list[Point]) -> list[tuple[float, int]]:
    """CBS(t) as a batch warmup (train.adapt_rule: schedule): from each measured point on, its local
    CBS estimate, never below an earlier point's (the batch only grows)."""
    out: list[tuple[float, int]] = []
    for p in sorted((p for p in points if p.result.measured), key=lambda p: p.fraction):
        out.append((round(p.fraction, 6), max(p.result.multiplier * p.batch, out[-1][1] if out else 0)))
    return out


def section(points: list[Point], tolerance: float, b_crit: tuple[float, float, float] | None) -> str:
    """The report's section: CBS(t) with its interval beside the exact and estimated noise scale."""
    if not points:
        return ""
    lines = [
        "## The local critical batch size through training (sweep.local_cbs)",
        "",
        f"Branched from batch {points[0].batch}'s run at each point: every seed trains one branch per batch on the "
        f"same examples; a batch is within the critical batch size while its branch keeps at least "
        f"{1 - tolerance:.0%} of the base branch's fall in val loss (one-sided paired t-tests over seeds, Holm "
        f"over the batches at {ALPHA / 2:.1%} each way: the interval covers with ≥ {1 - ALPHA:.0%}).",
        "",
        "| point (of the run) | epoch | local CBS (95% interval) | exact B_simple there | in-training estimate |"
        " CBS / B_simple (interval) |",
        "|---|---|---|---|---|---|",
    ]
    for p in points:
        f = p.figures()
        if not p.result.measured:
            lines.append(f"| {p.fraction:.0%} | {p.epoch} | not measured: the base branch's val loss did not fall |"
                         f" {_num(f['b_simple_exact'])} | {_num(f['b_simple_estimate'])} | |")
            continue
        wide = " (spans the grid)" if p.result.spans_grid else ""
        nan = math.nan
        lines.append(
            f"| {p.fraction:.0%} | {p.epoch} | {f['cbs']:.0f} ({f['cbs_low']:.0f}–{f['cbs_high']:.0f}){wide} | "
            f"{_num(f['b_simple_exact'])} | {_num(f['b_simple_estimate'])} | {_ratio(f.get('ratio_to_exact', nan))} "
            f"({_ratio(f.get('ratio_low', nan))}–{_ratio(f.get('ratio_high', nan))}) |"
        )
    lines += [
        "",
        f"The interval is on the grid of batches; off it (the ratio's interval) a lower end at batch "
        f"{points[0].batch} is 0, since the run's own batch is within by definition, and an upper end runs to the "
        "next batch, the first measurably worse (∞ past the grid's last).",
        "",
        _verdict(points, b_crit),
    ]
    warmup_plan = schedule(points)
    if warmup_plan:
        warmup = ", ".join(f"[{share:g}, {batch}]" for share, batch in warmup_plan)
        lines += ["", f"As a batch warmup (the adaptive batch's schedule rule): `train.adapt_schedule: [{warmup}]`."]
    return "\n".join(lines) + "\n"


def _verdict(points: list[Point], b_crit: tuple[float, float, float] | None) -> str:
    """What the points say: how the noise scale compares, and where the time-average falls."""
    found = figures(points, b_crit)
    parts = []
    ratios = [f for f in (p.figures() for p in points) if "ratio_low" in f]
    above = sum(1 for f in ratios if f["ratio_low"] > 1)
    below = sum(1 for f in ratios if f["ratio_high"] < 1)
    if ratios:
        parts.append(f"The exact noise scale underestimates the batch the run can take at {above} of {len(ratios)} "
                     f"points and overestimates it at {below} (the rest: the interval holds both).")
    if "local_cbs.mean" in found:
        where = found.get("local_cbs.mean_in_b_crit_interval")
        inside = {"yes": "inside", "no": "outside"}.get(str(where), "beside (no B_crit interval)")
        b = f" [{b_crit[1]:.0f}, {b_crit[2]:.0f}]" if b_crit is not None and where is not None else ""
        parts.append(f"The local CBS's time-average (the geometric mean over the points) "
                     f"{float(found['local_cbs.mean']):.0f} falls {inside} the global B_crit interval{b}.")
    return " ".join(parts)


def _num(v: float) -> str:
    return f"{v:.0f}" if v == v else "–"


def _ratio(v: float) -> str:
    return "∞" if v == math.inf else f"{v:.2g}" if v == v else "–"
