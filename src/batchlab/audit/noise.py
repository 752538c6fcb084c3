"""`batchlab noise-scale`: the exact gradient noise scale of a trained model, beside its estimate.

Every train row's gradient at the saved weights (models/model.pt), dropout's masks drawn `draws`
times a row (training/gns_exact.py), against the estimate training took at the same weights
(reports/train_summary.json's gns_at_saved_weights: its probe, pooled over four measurements, with
its 95% interval): what the in-training estimate is worth on this model and data. A model trained
before that figure existed is held to the last epoch's `gns.b_simple` (reports/history.csv), which
measured other weights.
"""

from __future__ import annotations

import json
import math

from batchlab import atomic, data
from batchlab.data import DataError
from batchlab.model import load_model
from batchlab.paths import Paths
from batchlab.training.gns_exact import batch_coupled, exact_at_weights


def report(paths: Paths, draws: int) -> str:
    """The exact figures at the saved weights, the logged estimate and their ratio, as lines."""
    if not paths.model.is_file():
        raise FileNotFoundError(f"{paths.model} does not exist: train first (`batchlab train` or `dvc repro train`)")
    model, _ = load_model(paths.model)
    if (why := batch_coupled(model)) is not None:
        raise DataError(f"{paths.model}: no noise scale {why}")
    exact = exact_at_weights(model, data.load(paths.data).train, draws)
    assert exact is not None  # batch_coupled said no above
    masks = f", {exact.draws} dropout masks a row" if exact.draws > 1 else ""
    lines = [
        f"exact B_simple = {exact.b_simple:.1f} at {paths.model} ({exact.rows} train rows' gradients{masks})",
        f"  |G|² = {exact.grad_sq:.6g}   tr(Σ) = {exact.trace:.6g}   dropout's part of tr(Σ) = {exact.trace_mask:.6g}",
    ]
    summary_path = paths.reports / "train_summary.json"
    saved = json.loads(summary_path.read_text()).get("gns_at_saved_weights") if summary_path.is_file() else None
    history = paths.reports / "history.csv"
    rows = atomic.read_csv(history) if history.is_file() else []
    logged = float(rows[-1].get("gns.b_simple") or math.nan) if rows else math.nan
    if saved and math.isfinite(saved["b_simple"]):
        b, low, high = saved["b_simple"], saved["b_simple_ci95_low"], saved["b_simple_ci95_high"]
        interval = f" (95% interval {low:.1f}–{high:.1f})" if math.isfinite(low) else ""
        lines.append(
            f"  training's estimate at the same weights = {b:.1f}{interval}, {int(saved['probes'])} probes pooled: "
            f"{b / exact.b_simple:.2f}x exact"
        )
    elif math.isfinite(logged):
        lines.append(
            f"  training's estimate (gns.b_simple, last epoch: other weights than these) = {logged:.1f}: "
            f"{logged / exact.b_simple:.2f}x exact"
        )
    else:
        lines.append("  training logged no estimate (train.gns off, or no probe reading was complete)")
    return "\n".join(lines)
