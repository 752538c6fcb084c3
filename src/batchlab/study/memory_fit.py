"""The largest batch within a memory budget, from the step memory measured at the sweep's batch sizes."""

from __future__ import annotations

import math


def largest_batch_within(budget_mib: float, points: list[tuple[int, float]]) -> int | None:
    """The largest batch whose memory on the least-squares line memory = a + b·batch through the
    measured (batch, MiB) `points` is at most `budget_mib`; None if even batch 1 is over budget.

    This extrapolates: beyond the largest measured batch it trusts the line. An MLP's step memory is
    linear in the batch, but allocator rounding and kernel workspaces can bend it on a device, so
    measure near the answer before relying on it.
    """
    batches = [float(b) for b, _ in points]
    if len(set(batches)) < 2:
        raise ValueError(f"fitting memory against batch size needs at least 2 distinct batch sizes, got {points}")
    mibs = [m for _, m in points]
    mean_b, mean_m = sum(batches) / len(batches), sum(mibs) / len(mibs)
    slope = sum((b - mean_b) * (m - mean_m) for b, m in zip(batches, mibs, strict=True)) / sum(
        (b - mean_b) ** 2 for b in batches
    )
    intercept = mean_m - slope * mean_b
    if slope <= 0:
        raise ValueError(f"memory does not grow with batch size in {points}: no largest batch to predict")
    exact = (budget_mib - intercept) / slope
    # a batch the line puts at the budget, up to float rounding, fits
    largest = round(exact) if math.isclose(exact, round(exact), rel_tol=1e-9, abs_tol=1e-9) else math.floor(exact)
    return largest if largest >= 1 else None
