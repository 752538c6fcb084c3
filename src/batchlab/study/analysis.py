"""The batch-size study's analysis: results in, figures and a verdict out (no I/O).

Per batch size it keeps the learning rate with the best val loss, finds the step at which each
experiment first reached one target val loss, fits the critical batch size (critical.py), reads
the gradient noise scale at the target, and decides which batch size to use (verdict.py).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from batchlab.study import critical
from batchlab.study.adaptive import AdaptiveStudy, compare, seconds_at
from batchlab.study.memory_fit import largest_batch_within
from batchlab.study.verdict import Verdict, decide, mean_ci

# per experiment, shown per batch size as a mean with its 95% CI, in the table's order
FIGURES = (
    "test_f1_macro",
    "test_accuracy",
    "steps_to_target",
    "examples_to_target",
    "seconds_to_target",
    "samples_per_s",
    "step_memory_mib",
    "step_memory_plain_mib",
    "gns_b_simple_at_target",
    "gns_b_simple_exact_at_target",
    "grad_norm_mean",
    "peak_rss_mib",
    "epoch_seconds",
    "overhead_seconds",
)

# measured once per batch size when its seeds share it: the speed and step-memory probes (cached
# per batch size and lr), and a process's peak RSS when the seeds train together in one
SHARED = ("samples_per_s", "epoch_seconds", "step_memory_mib", "step_memory_plain_mib", "peak_rss_mib")


def pick_lrs(results: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[int, float]]:
    """Per batch size, the lr multiplier whose experiments reach the lowest val loss (mean over
    seeds); returns the experiments kept and each batch size's winning multiplier."""
    best_loss: dict[tuple[int, float], list[float]] = defaultdict(list)
    for r in results:
        best_loss[(r["batch_size"], r["lr_multiplier"])].append(min(r["curve_val_loss"]))
    chosen: dict[int, float] = {}
    for (batch, mult), losses in sorted(best_loss.items()):
        if batch not in chosen or statistics.fmean(losses) < statistics.fmean(best_loss[(batch, chosen[batch])]):
            chosen[batch] = mult
    kept = [r for r in results if chosen[r["batch_size"]] == r["lr_multiplier"]]
    return kept, chosen


def reading_at(result: dict[str, Any], step: int) -> tuple[float, int | None]:
    """The noise-scale reading the study reads at `step`, and the step whose weights it measured:
    the latest probe's that measured the weights at or before `step` (its reading completes a
    window later, so it is read further along the curve). A sweep's probe measures a val point's
    weights (sweep/plan.py), so the exact value is taken at the same weights (sweep/truth.py).
    A result from before that column: the reading complete at `step`, its weights unknown."""
    measured = result.get("curve_b_simple_measured_at")
    if not measured:
        return result["curve_b_simple"][result["curve_steps"].index(step)], None
    latest: tuple[float, float] | None = None
    for value, at in zip(result["curve_b_simple"], measured, strict=True):
        if math.isfinite(at) and at <= step and (latest is None or at > latest[1]):
            latest = (value, at)
    return (latest[0], int(latest[1])) if latest is not None else (math.nan, None)


def reach(result: dict[str, Any], target: float) -> dict[str, Any]:
    """The experiment with its steps, examples and training seconds to `target` (None: never)."""
    step = critical.first_reach(result["curve_steps"], result["curve_val_loss"], target)
    if step is None:
        return {
            **result,
            **dict.fromkeys(("steps_to_target", "examples_to_target", "seconds_to_target", "gns_b_simple_at_target")),
        }
    at, losses = result["curve_steps"].index(step), result["curve_val_loss"]
    steps = critical.crossing(result["curve_steps"], losses, at, target)
    # an adaptive run's batch changes: its val curve counts the examples (older rows have no column)
    examples = (
        critical.crossing(result["curve_examples"], losses, at, target)
        if result.get("curve_examples")
        else steps * result["batch_size"]
    )
    # on the sweep's clock (the throughput table: each epoch's steps and probes, sweep/scoring.py),
    # interpolated within the epoch; an older row's at its median throughput, an adaptive one's at
    # its own epochs' (scoring the val split along the way is not training time)
    timed = result.get("clock") == "table" or result.get("adaptive")
    seconds = seconds_at(result, examples) if timed else examples / result["samples_per_s"]
    reading, measured = reading_at(result, step)
    return {
        **result,
        "steps_to_target": steps,
        "examples_to_target": examples,
        "seconds_to_target": seconds,
        "gns_b_simple_at_target": reading,
        "gns_b_simple_measured_at": measured,
    }


def _finite(values: list[Any]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def aggregate(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per batch size: mean and 95% CI half-width of every figure over the seeds that
    have it (`reached`: how many seeds reached the target). A SHARED figure every seed has the same
    value of is one measurement they share, so it has no interval: NaN, not ± 0."""
    by_batch: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        by_batch[r["batch_size"]].append(r)
    rows = []
    for batch, runs in sorted(by_batch.items()):
        row: dict[str, Any] = {
            "batch_size": batch,
            "lr": runs[0]["lr"],
            "lr_multiplier": runs[0]["lr_multiplier"],
            "seeds": len(runs),
            "reached": sum(r["steps_to_target"] is not None for r in runs),
        }
        for key in FIGURES:
            values = _finite([r.get(key) for r in runs])
            mean, half = mean_ci(values) if values else (math.nan, math.nan)
            if key in SHARED and len(values) > 1 and len(set(values)) == 1:  # one measurement: no interval
                half = math.nan
            row[f"{key}_mean"], row[f"{key}_ci95"] = mean, half
        rows.append(row)
    return rows


@dataclass(frozen=True)
class NoiseTruth:
    """The exact noise scale at the target (sweep/truth.py), where the train split allowed it."""

    b_simple: float = math.nan  # the median over the experiments that reached the target
    # the median over them of the estimate / the exact value at the weights the estimate measured
    estimate_over_exact: float = math.nan
    count: int = 0  # experiments with an exact value


@dataclass(frozen=True)
class Study:
    results: list[dict[str, Any]]  # the experiments kept (the winning lr per batch size), with their reach
    rows: list[dict[str, Any]]  # one per batch size
    lr_choice: dict[int, float]  # batch size -> winning lr multiplier
    target: float
    target_rule: str
    fit: critical.Fit | critical.NoFit
    b_simple: float  # the median gradient noise scale at the target over the experiments (NaN: none)
    verdict: Verdict
    n_test: int
    budget_batch: int | None  # the largest batch predicted to fit sweep.memory_budget_mb
    # experiments that reached the target whose noise-scale reading there is undefined (no probe
    # yet, or an estimate of |G|² at or below zero): left out of b_simple, and counted
    b_simple_unread: int = 0
    truth: NoiseTruth = NoiseTruth()
    adaptive: AdaptiveStudy | None = None  # sweep.adaptive's row, against every fixed batch size

    def figures(self) -> dict[str, float | int]:
        """The headline numbers: `dvc metrics show`, the parent run's study.* tags."""
        out: dict[str, float | int] = {
            "best_f1_batch_size": self.verdict.best,
            "recommended_batch_size": self.verdict.recommended,
            "target_val_loss": self.target,
            "test_rows": self.n_test,
            "seeds": min(r["seeds"] for r in self.rows),
        }
        # the recommendation's price against the best-F1 batch: the speed-up to the target, the F1 difference
        if math.isfinite(self.verdict.speedup):
            out["recommended_speedup"] = self.verdict.speedup
        out["recommended_f1_minus_best"] = self.verdict.f1_diff[0]
        if isinstance(self.fit, critical.Fit):
            out.update(b_crit=self.fit.b_crit, s_min=self.fit.s_min, e_min=self.fit.e_min, fit_r2=self.fit.r2)
            if math.isfinite(self.fit.b_crit_low):
                out.update(b_crit_ci95_low=self.fit.b_crit_low, b_crit_ci95_high=self.fit.b_crit_high)
            if math.isfinite(self.fit.b_excess):
                out["b_excess20"] = self.fit.b_excess
            for key, value in (("low", self.fit.b_excess_low), ("high", self.fit.b_excess_high)):
                if math.isfinite(value):
                    out[f"b_excess20_ci95_{key}"] = value
            if math.isfinite(self.b_simple) and self.b_simple > 0:
                out["b_crit_over_b_simple"] = self.fit.b_crit / self.b_simple
        if math.isfinite(self.b_simple):
            out["b_simple_at_target"] = self.b_simple
        out["b_simple_unread_at_target"] = self.b_simple_unread
        if self.truth.count:
            out["b_simple_exact_at_target"] = self.truth.b_simple
            if math.isfinite(self.truth.estimate_over_exact):
                out["b_simple_estimate_over_exact"] = self.truth.estimate_over_exact
            if isinstance(self.fit, critical.Fit) and self.truth.b_simple > 0:
                out["b_crit_over_b_simple_exact"] = self.fit.b_crit / self.truth.b_simple
        if self.budget_batch is not None:
            out["largest_batch_within_budget"] = self.budget_batch
        if self.adaptive is not None:
            for figure in ("seconds_to_target", "test_f1_macro"):
                if math.isfinite(mean := self.adaptive.figures[figure][0]):
                    out[f"adaptive_{figure}"] = mean
        return out


def target_of(kept: list[dict[str, Any]], target_val_loss: float | None) -> tuple[float, str]:
    """The target val loss of the experiments kept (`pick_lrs`), and the rule that set it."""
    if target_val_loss is not None:
        return target_val_loss, "sweep.target_val_loss"
    rule = (
        f"the highest of the experiments' lowest val losses, plus {critical.TARGET_MARGIN:.0%}, "
        "so every experiment reaches it (sweep.target_val_loss sets another)"
    )
    return critical.auto_target([r["curve_val_loss"] for r in kept]), rule


def analyse(
    results: list[dict[str, Any]], n_test: int, target_val_loss: float | None, memory_budget_mb: float | None
) -> Study:
    adaptive = [r for r in results if r.get("adaptive")]
    kept, lr_choice = pick_lrs([r for r in results if not r.get("adaptive")])
    target, rule = target_of(kept, target_val_loss)
    kept = [reach(r, target) for r in kept]
    rows = aggregate(kept)
    fit = critical.fit([(r["batch_size"], r["steps_to_target"]) for r in kept])
    readings = [r["gns_b_simple_at_target"] for r in kept if r["steps_to_target"] is not None]
    at_target = _finite(readings)
    b_simple = statistics.median(at_target) if at_target else math.nan
    exact = _finite([r.get("gns_b_simple_exact_at_target") for r in kept if r["steps_to_target"] is not None])
    # each reading against the exact value at the weights it measured (older rows: at the target's)
    truths = [r.get("gns_b_simple_exact_at_reading", r.get("gns_b_simple_exact_at_target")) for r in kept]
    both = [_finite([r["gns_b_simple_at_target"], there]) for r, there in zip(kept, truths, strict=True)]
    pairs = [estimate / exact for estimate, exact in (p for p in both if len(p) == 2) if exact > 0]
    truth = NoiseTruth(
        statistics.median(exact) if exact else math.nan, statistics.median(pairs) if pairs else math.nan, len(exact)
    )
    f1: dict[int, dict[int, float]] = defaultdict(dict)
    for r in kept:
        f1[r["batch_size"]][r["seed"]] = r["test_f1_macro"]
    seconds = {
        row["batch_size"]: row["seconds_to_target_mean"] if row["reached"] == row["seeds"] else None for row in rows
    }
    throughput = {row["batch_size"]: row["samples_per_s_mean"] for row in rows}
    verdict = decide(f1, seconds, throughput, n_test)
    budget_batch = None
    if memory_budget_mb is not None:
        points = [(row["batch_size"], row["step_memory_mib_mean"]) for row in rows]
        budget_batch = largest_batch_within(memory_budget_mb, points)
    unread = len(readings) - len(at_target)
    against = compare([reach(r, target) for r in adaptive], kept) if adaptive else None
    return Study(
        kept, rows, lr_choice, target, rule, fit, b_simple, verdict, n_test, budget_batch, unread, truth, against
    )


@dataclass(frozen=True)
class Band:
    """One batch size's val loss over its seeds at each scored step: the mean and its 95% interval
    (Student's t over the seeds scored there; NaN where fewer than two were)."""

    batch_size: int
    examples: list[int]
    mean: list[float]
    low: list[float]
    high: list[float]


def seed_bands(results: list[dict[str, Any]]) -> list[Band]:
    """The val-loss curves as bands over seeds (the val-loss plot draws them), by batch size."""
    bands = []
    for batch in sorted({r["batch_size"] for r in results}):
        by_step: dict[int, list[float]] = {}
        for r in results:
            if r["batch_size"] == batch:
                for step, loss in zip(r["curve_steps"], r["curve_val_loss"], strict=True):
                    if math.isfinite(loss):
                        by_step.setdefault(step, []).append(loss)
        steps = sorted(by_step)
        cis = [mean_ci(by_step[s]) for s in steps]
        bands.append(Band(batch, [s * batch for s in steps], [m for m, _ in cis],
                          [m - h for m, h in cis], [m + h for m, h in cis]))
    return bands
