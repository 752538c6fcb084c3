"""The exact noise scale at the target, beside the estimate the study reads there.

An experiment within sweep.exact_noise_rows keeps its weights at each val point
(train.curve_weights, reports/curve_weights.pt); once the study knows the target, the weights at
the point where each experiment first reached it give the exact B_simple from every train row's
gradient (training/gns_exact.py); and at the weights the in-training reading the study reads there
measured (a sweep's probe measures a val point's weights), which is what that estimate is held to:
B_simple at one iterate scatters by 2x and more from one val point to the next, so a reading at
other weights is no check of the estimator. Once the experiments have finished, each experiment's
values are a task of the sweep (tasks.Truth), run by its executor and kept in the experiment's
reports/exact_noise.json, keyed by its key and by step; the report only reads them.
"""

from __future__ import annotations

import math
from typing import Any

from batchlab import atomic, data, kept
from batchlab.config import Config
from batchlab.paths import Paths
from batchlab.study import analysis, critical
from batchlab.sweep import plan
from batchlab.sweep.tasks import Truth
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


def stored(folder: Paths, key: str) -> dict[str, dict[str, float] | None]:
    """The exact figures kept for the experiment keyed `key` in `folder`, by step (None: not
    computable there: its weights were not kept, or the model has no per-row gradient)."""
    return dict((kept.read(folder.reports / EXACT, key) or {}).get("steps", {}))


def _steps(r: dict[str, Any], target: float) -> tuple[int | None, int | None]:
    """The step where the experiment first reached `target`, and the step whose weights the
    study's reading there measured (analysis.reading_at: the latest probe at or before it)."""
    step = critical.first_reach(r["curve_steps"], r["curve_val_loss"], target)
    return step, (analysis.reading_at(r, step)[1] if step is not None else None)


def work(paths: Paths, results: list[dict[str, Any]], target: float) -> list[Truth]:
    """The truth tasks still to run once the study knows its target: one for each experiment that
    kept its weights and reached it, whose figures at those two steps are not stored under its key."""
    out = []
    for r in results:
        if not r.get("curve_weights"):
            continue
        step, measured = _steps(r, target)
        if step is None:
            continue
        steps = tuple(sorted({step} | ({measured} if measured is not None else set())))
        known = stored(plan.folder_named(paths, r["name"]), r["fingerprint"])
        if any(str(s) not in known for s in steps):
            out.append(Truth(r["name"], r["fingerprint"], steps, keep=step))
    return out


def compute(cfg: Config, paths: Paths, task: Truth) -> dict[str, Any]:
    """A truth task (groups.train_work, in a lane or on a Dask worker): the exact figures at its
    steps from the experiment's kept weights (training/curve_weights.py), stored in its
    reports/exact_noise.json under its key and returned as stored. The weights after `keep` (the
    target's step) go: a study that gains experiments only raises the automatic target (the highest
    lowest val loss), and they are most of the file."""
    folder = plan.folder_named(paths, task.experiment)
    known = stored(folder, task.key)
    saved = CurveWeights.load(folder.curve_weights)
    if saved is not None and task.keep in saved.steps:
        saved = saved.keep_first(saved.steps.index(task.keep) + 1)
    dataset = data.load(paths.data)
    for step in (s for s in task.steps if str(s) not in known):
        exact = saved.exact_at(step, cfg.model, dataset) if saved is not None and step in saved.steps else None
        known[str(step)] = None if exact is None else {
            "b_simple": exact.b_simple, "grad_sq": exact.grad_sq, "trace": exact.trace,
            "trace_mask": exact.trace_mask, "rows": exact.rows, "draws": exact.draws}
    content = {"key": task.key, "steps": known}
    keep(paths, task, content)  # a retrained experiment's key differs
    return content


def keep(paths: Paths, task: Truth, content: dict[str, Any]) -> None:
    """A truth task's figures stored in the experiment's folder under `paths` (the worker's, or
    the sweep's own when a Dask worker returned them)."""
    atomic.write_json(plan.folder_named(paths, task.experiment).reports / EXACT, content)


def with_exact(folders: dict[str, Paths], results: list[dict[str, Any]], target: float) -> list[dict[str, Any]]:
    """The results, each that kept its weights with `gns_b_simple_exact_at_target` and
    `gns_b_simple_exact_at_reading`, the exact value at the weights the study's reading there
    measured, what the estimate is compared with: read from what the truth tasks stored, NaN where
    there is none (it never reached `target`, or its weights there were gone). `folders`: each
    experiment's outputs, by name."""
    out = []
    for r in results:
        if not r.get("curve_weights"):
            out.append(r)
            continue
        step, measured = _steps(r, target)
        known = stored(folders[r["name"]], r["fingerprint"])
        exact = known.get(str(step)) if step is not None else None
        there = known.get(str(measured)) if measured is not None else None
        out.append({**r, "gns_b_simple_exact_at_target": exact["b_simple"] if exact else math.nan,
                    "gns_b_simple_exact_at_reading": there["b_simple"] if there else math.nan})
    return out
