"""`batchlab noise-scale`: the exact gradient noise scale of a trained model, beside its estimate.

Every train row's gradient at the saved weights (models/model.pt), dropout's masks drawn `draws`
times a row (training/gns_exact.py), against the `gns.b_simple` training logged last
(reports/history.csv): what the in-training estimate is worth on this model and data.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from batchlab import atomic, data
from batchlab.data import DataError
from batchlab.model import load_model
from batchlab.paths import Paths
from batchlab.training.gns_exact import batch_coupled, exact_noise_scale
from batchlab.training.train import split_tensors


def report(paths: Paths, draws: int) -> str:
    """The exact figures at the saved weights, the logged estimate and their ratio, as lines."""
    if not paths.model.is_file():
        raise FileNotFoundError(f"{paths.model} does not exist: train first (`batchlab train` or `dvc repro train`)")
    model, _ = load_model(paths.model)
    if (why := batch_coupled(model)) is not None:
        raise DataError(f"{paths.model}: no noise scale {why}")
    dataset = data.load(paths.data)
    x, y = split_tensors(dataset.train, torch.device("cpu"))
    exact = exact_noise_scale(model.train(), F.cross_entropy, x, y, draws=draws)
    history = paths.reports / "history.csv"
    rows = atomic.read_csv(history) if history.is_file() else []
    logged = float(rows[-1].get("gns.b_simple") or math.nan) if rows else math.nan
    masks = f", {exact.draws} dropout masks a row" if exact.draws > 1 else ""
    lines = [
        f"exact B_simple = {exact.b_simple:.1f} at {paths.model} ({exact.rows} train rows' gradients{masks})",
        f"  |G|² = {exact.grad_sq:.6g}   tr(Σ) = {exact.trace:.6g}   dropout's part of tr(Σ) = {exact.trace_mask:.6g}",
    ]
    if math.isfinite(logged):
        lines.append(
            f"  training's estimate (gns.b_simple, last epoch) = {logged:.1f}: {logged / exact.b_simple:.2f}x exact"
        )
    else:
        lines.append("  training logged no estimate (train.gns off, or no probe reading was complete)")
    return "\n".join(lines)
