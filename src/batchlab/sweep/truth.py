"""The exact noise scale at the target, beside the estimate the study reads there.

An experiment within sweep.exact_noise_rows keeps its weights at each val point
(train.curve_weights, reports/curve_weights.pt); once the study knows the target, the weights at
the point where each experiment first reached it give the exact B_simple from every train row's
gradient (training/gns_exact.py); and at the weights the in-training reading the study reads there
measured (a sweep's probe measures a val point's weights), which is what that estimate is held to:
B_simple at one iterate scatters by 2x and more from one val point to the next, so a reading at
other weights is no check of the estimator. Each value is kept in the experiment's reports/exact_noise.json,
keyed by step, so a report rewritten later computes nothing again.
"""

from __future__ import annotations

import math
from typing import Any

from batchlab import atomic, data, kept
from batchlab.config import Config
from batchlab.paths import Paths
from batchlab.study import analysis, critical
from batchlab.training.curve_weights import CurveWeights

EXACT = "exact_noise.json"


def trim(folder: Paths, curve_val_loss: list[float], target_val_loss: float | None) -> None:
    """Keep the weights of the points a target can fall on: up to the first at or below
    sweep.target_val_loss, or, for the automatic target (never below this curve's lowest val loss
    plus the margin), up to the first at or below that."""
    bound = target_val_loss if target_val_loss is not None else min(curve_val_loss) * (1 + critical.TARGET_MARGIN)
    last = next((i for i, loss in enumerate(curve_val_loss) if loss <= bound), len(curve_val_loss) - 1)
    saved = CurveWeights.load(folder.curve_weights)
    if saved is not None:
        saved.keep_first(last + 1)


def exact_at(
    cfg: Config, folder: Paths, dataset: data.Dataset, step: int, key: str, trim: bool = True
) -> dict[str, float] | None:
    """The exact figures at `step` of the experiment keyed `key` whose outputs are in `folder`
    (None: its weights there were not kept). With `trim` (`step` is the target's) the weights after
    that point go: a study that gains experiments only raises the automatic target (the highest
    lowest val loss), and they are most of the file."""
    cache = folder.reports / EXACT
    known: dict[str, dict[str, float]] = (kept.read(cache, key) or {}).get("steps", {})
    saved = CurveWeights.load(folder.curve_weights)
    if trim and saved is not None and step in saved.steps:
        saved = saved.keep_first(saved.steps.index(step) + 1)
    if str(step) in known:
        return known[str(step)]
    if saved is None or step not in saved.steps:
        return None
    exact = saved.exact_at(step, cfg.model, dataset)
    if exact is None:  # no per-row gradient: no exact value to compare with
        return None
    known[str(step)] = {"b_simple": exact.b_simple, "grad_sq": exact.grad_sq, "trace": exact.trace,
                        "trace_mask": exact.trace_mask, "rows": exact.rows, "draws": exact.draws}
    atomic.write_json(cache, {"key": key, "steps": known})  # a retrained experiment's key differs
    return known[str(step)]


def with_exact(
    cfg: Config, dataset: data.Dataset, folders: dict[str, Paths], results: list[dict[str, Any]], target: float
) -> list[dict[str, Any]]:
    """The results, each that kept its weights with `gns_b_simple_exact_at_target` and
    `gns_b_simple_exact_at_reading`, the exact value at the weights the study's reading there
    measured (analysis.reading_at: the latest probe at or before the target), what the estimate is
    compared with; NaN where it cannot be computed: it never reached `target`, or its weights there
    are gone. `folders`: each experiment's outputs, by name."""
    out = []
    for r in results:
        if not r.get("curve_weights"):
            out.append(r)
            continue
        step = critical.first_reach(r["curve_steps"], r["curve_val_loss"], target)
        folder = folders[r["name"]]
        exact = exact_at(cfg, folder, dataset, step, r["fingerprint"]) if step is not None else None
        # at or before the target: its weights are kept (exact_at keeps those up to `step`)
        measured = analysis.reading_at(r, step)[1] if step is not None else None
        there = exact_at(cfg, folder, dataset, measured, r["fingerprint"], trim=False) if measured is not None else None
        out.append({**r, "gns_b_simple_exact_at_target": exact["b_simple"] if exact else math.nan,
                    "gns_b_simple_exact_at_reading": there["b_simple"] if there else math.nan})
    return out
