"""sweep.adaptive: the adaptive row against every fixed batch size, paired by seed.

Each figure (steps, examples and seconds to the target, test F1) is compared with each fixed batch
size's on the seeds both have (the same seed: the same initial weights and data order): the mean
of the paired differences, adaptive minus fixed, with its 95% Student-t interval, and the paired
t-test's p-value. A difference is "measurable" when Holm's step-down correction over every one of
these comparisons (4 figures x the fixed batch sizes) rejects it at 5% family-wise error, the
study's control for picking among many comparisons (verdict.py).

Its seconds to the target are its own training seconds up to the step that reached it
(interpolated within that epoch), each epoch's counted at the median throughput of its epochs at
the same batch (sweep/scoring.py): the fixed rows' rule (examples / their median throughput) per
stretch of its schedule, so a slow epoch of a busy machine moves neither much. They include what
adapting costs: the noise probe it reads before each decision.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchlab.study.verdict import holm, mean_ci, paired_p_value

if TYPE_CHECKING:
    from batchlab.study.analysis import Study

COMPARED = ("seconds_to_target", "test_f1_macro", "steps_to_target", "examples_to_target")


def seconds_at(result: dict[str, Any], examples: float) -> float:
    """Training seconds after `examples` examples: linear within the epoch that saw them."""
    ends, seconds = result["epoch_examples"], result["epoch_train_seconds"]
    i = min(bisect.bisect_left(ends, examples), len(ends) - 1)
    start_examples, start_seconds = (ends[i - 1], seconds[i - 1]) if i else (0, 0.0)
    share = (examples - start_examples) / max(1, ends[i] - start_examples)
    return start_seconds + share * (seconds[i] - start_seconds)


@dataclass(frozen=True)
class Comparison:
    batch_size: int
    figure: str
    diff_mean: float  # adaptive − fixed, over the seeds both have a value for
    diff_ci95: float  # the half-width of its 95% interval (NaN with fewer than two pairs)
    p_value: float  # the paired t-test's, two-sided
    pairs: int
    measurable: bool = False  # rejected by Holm over every comparison


@dataclass(frozen=True)
class AdaptiveStudy:
    results: list[dict[str, Any]]  # the adaptive experiments, with their reach
    figures: dict[str, tuple[float, float]]  # figure -> (mean, 95% half-width) over seeds
    comparisons: list[Comparison]
    reached: int

    def against(self, batch: int, figure: str) -> Comparison:
        return next(c for c in self.comparisons if c.batch_size == batch and c.figure == figure)


def _by_seed(results: list[dict[str, Any]], figure: str) -> dict[int, float]:
    return {r["seed"]: float(r[figure]) for r in results if r.get(figure) is not None and math.isfinite(r[figure])}


def compare(adaptive: list[dict[str, Any]], fixed: list[dict[str, Any]]) -> AdaptiveStudy:
    """`adaptive`: its experiments after analysis.reach; `fixed`: the fixed ones kept."""
    figures = {}
    for figure in COMPARED:
        values = list(_by_seed(adaptive, figure).values())
        figures[figure] = mean_ci(values) if values else (math.nan, math.nan)
    raw = []
    for batch in sorted({r["batch_size"] for r in fixed}):
        runs = [r for r in fixed if r["batch_size"] == batch]
        for figure in COMPARED:
            a, f = _by_seed(adaptive, figure), _by_seed(runs, figure)
            diffs = [a[s] - f[s] for s in sorted(set(a) & set(f))]
            mean, half = mean_ci(diffs) if diffs else (math.nan, math.nan)
            raw.append(Comparison(batch, figure, mean, half, paired_p_value(a, f), len(diffs)))
    rejected = holm({(c.batch_size, COMPARED.index(c.figure)): c.p_value for c in raw})
    comparisons = [
        Comparison(c.batch_size, c.figure, c.diff_mean, c.diff_ci95, c.p_value, c.pairs,
                   (c.batch_size, COMPARED.index(c.figure)) in rejected)
        for c in raw
    ]
    reached = sum(r.get("steps_to_target") is not None for r in adaptive)
    return AdaptiveStudy(adaptive, figures, comparisons, reached)


def verdict_text(study: AdaptiveStudy, fastest: int | None, best_f1: int) -> str:
    """The adaptive row's answer: against the fastest fixed batch to the target and the best F1."""
    sec, f1 = study.figures["seconds_to_target"], study.figures["test_f1_macro"]
    seeds = len(study.results)
    lines = [
        f"Adaptive ({seeds} seeds, reached the target: {study.reached}): {_pm(*sec, 2)} s to the target, "
        f"test F1 {_pm(*f1, 4)}."
    ]
    faster, slower, worse = _measurable(study, "seconds_to_target", -1), _measurable(study, "seconds_to_target", 1), \
        _measurable(study, "test_f1_macro", -1)
    lines.append(
        f"Measurably faster to the target than batch: {_names(faster)}; measurably slower than: {_names(slower)}; "
        f"measurably lower test F1 than: {_names(worse)}."
    )
    goal = best_f1 not in worse and (fastest is None or fastest not in slower)
    against = f"the fastest fixed batch ({fastest if fastest is not None else 'none reached the target'})"
    lines.append(
        f"Against {against} and the best F1 (batch {best_f1}): {'met' if goal else 'not met'} "
        "(not measurably slower, not measurably worse in F1; Holm over every comparison at 5%)."
    )
    return " ".join(lines)


def _measurable(study: AdaptiveStudy, figure: str, sign: int) -> list[int]:
    """The fixed batch sizes `figure` differs from measurably, adaptive above them (sign 1) or below (-1)."""
    return [c.batch_size for c in study.comparisons if c.figure == figure and c.measurable and c.diff_mean * sign > 0]


def _names(batches: list[int]) -> str:
    return ", ".join(map(str, batches)) or "none"


def _pm(mean: float, half: float, digits: int) -> str:
    if not math.isfinite(mean):
        return "—"
    return f"{mean:.{digits}f}" + (f" ± {half:.{digits}f}" if math.isfinite(half) else "")


def study_verdict(study: Study) -> str:
    """The adaptive row's verdict, against the fastest fixed batch size to the target and the best F1."""
    assert study.adaptive is not None
    reached = {r["batch_size"]: r["seconds_to_target_mean"] for r in study.rows if r["reached"] == r["seeds"]}
    fastest = min(reached, key=lambda b: reached[b]) if reached else None
    return verdict_text(study.adaptive, fastest, study.verdict.best)


def study_text(study: Study) -> str:
    """sweep.adaptive: its verdict, then each fixed batch size's paired differences (adaptive − fixed)."""
    assert study.adaptive is not None
    lines = [
        study_verdict(study),
        "",
        "Adaptive − fixed, paired by seed (mean ± 95% CI; * measurable under Holm's correction over all "
        f"{len(study.adaptive.comparisons)} comparisons):",
        "",
        "| fixed batch | Δ steps to target | Δ examples to target | Δ seconds to target | Δ test F1 |",
        "|---|---|---|---|---|",
    ]
    digits = {"steps_to_target": 0, "examples_to_target": 0, "seconds_to_target": 2, "test_f1_macro": 4}
    for batch in sorted(study.lr_choice):
        cells = []
        for figure in ("steps_to_target", "examples_to_target", "seconds_to_target", "test_f1_macro"):
            c = study.adaptive.against(batch, figure)
            half = f" ± {c.diff_ci95:.{digits[figure]}f}" if math.isfinite(c.diff_ci95) else ""
            text = f"{c.diff_mean:+.{digits[figure]}f}{half}{' *' if c.measurable else ''}"
            cells.append(text if math.isfinite(c.diff_mean) else "—")
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", *schedule_lines(study)])


def schedule_lines(study: Study) -> list[str]:
    """Each seed's schedule: every change, with the B_noise it read and, under the time rule, the
    throughput table's optimum √(a·B_noise/b) there."""
    assert study.adaptive is not None
    lines = ["Schedules (the batch from each step on; B_noise read there; the table's optimum):", ""]
    for r in sorted(study.adaptive.results, key=lambda r: r["seed"]):
        decisions = r.get("batch_schedule") or []
        moves = [
            f"{d['to']} (step {d['step']}, B_noise {d['b_noise']:.0f}"
            + (f", optimum {d['optimum']:.0f})" if d.get("optimum") is not None else ")")
            for d in decisions
            if d["to"] != d["from"]
        ]
        start = decisions[0]["from"] if decisions else r["batch_size"]
        lines.append(f"- seed {r['seed']}: " + " → ".join([str(start), *moves]))
    return lines
