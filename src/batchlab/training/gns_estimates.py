"""The noise scale's estimators, no state: what one probe's measurement reads (|G|², tr(Σ)), its
standard error, and readings pooled at one set of weights. gns.py explains the measurement;
gns_probes.py takes it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FullSplitMeasure:
    """What the full-split probe measured at one step (gns_probes.FullSplitProbe), on the device."""

    cross: torch.Tensor  # ḡ¹·ḡ²: the mean gradients over `rows` rows, two independent dropout draws
    half_diff_sq: torch.Tensor  # |ḡ¹ - ḡ²|² / 2 (0 with one pass): the masks' noise, tr(Σ_mask)/rows
    rows: int
    half_window: int = 16  # steps each side of the probe whose norms give tr(Σ) (without row_sq)
    # the mean over sampled rows of |g_row|², one mask each (E: |G|² + tr(Σ)): the reading is then
    # complete at the probe, all at its weights (`per_row_estimate`)
    row_sq: torch.Tensor | None = None
    row_sq_var: torch.Tensor | None = None  # the variance of row_sq over the rows drawn: the reading's standard error
    cross_var: torch.Tensor | None = None  # the variance of `cross` from the masks (gns_probes._cross_variance)


def full_split_estimate(
    cross: float, half_diff_sq: float, steps_sq: float, rows: int, batch: int, population: int | None
) -> tuple[float, float]:
    """|G|² and tr(Σ) from a full-split measurement over `rows` rows and the mean squared norm of
    the steps' gradients (over `batch` rows each) around it:
    E[cross] = |G|² + tr(Σ_rows)·c, E[steps_sq] = |G|² + tr(Σ_rows)·d + tr(Σ_mask)/batch, with
    c = (N-M)/(M(N-1)) and d = (N-B)/(B(N-1)) (1/M and 1/B for an endless stream, N None), and
    tr(Σ_mask) = M·half_diff_sq. NaN when the step's batch is no smaller than the probe's rows."""
    trace_mask = rows * half_diff_sq
    if population is None:
        c, d = 1.0 / rows, 1.0 / batch
    else:
        c = (population - rows) / (rows * max(population - 1, 1))
        d = (population - batch) / (batch * max(population - 1, 1))
    if d <= c:
        return math.nan, math.nan
    trace_rows = (steps_sq - cross - trace_mask / batch) / (d - c)
    return cross - c * trace_rows, trace_rows + trace_mask


def per_row_estimate(
    cross: float, half_diff_sq: float, row_sq: float, rows: int, population: int | None
) -> tuple[float, float]:
    """|G|² and tr(Σ) at one set of weights from a full-split measurement over `rows` rows and the
    mean squared norm of sampled rows' own gradients: E[row_sq] = |G|² + tr(Σ_rows) + tr(Σ_mask),
    E[cross] = |G|² + tr(Σ_rows)·c (c as in `full_split_estimate`: 0 over the whole split)."""
    trace_mask = rows * half_diff_sq
    c = 1.0 / rows if population is None else (population - rows) / (rows * max(population - 1, 1))
    if c >= 1:  # one row of an endless stream: no |G|² apart from its noise
        return math.nan, math.nan
    grad_sq = (cross - c * (row_sq - trace_mask)) / (1 - c)
    return grad_sq, row_sq - grad_sq


def standard_error(grad_sq: float, trace: float, cross_var: float, row_sq_var: float) -> float:
    """The standard error of one reading's B_simple = tr(Σ)/|G|² = R/|G|² - 1, R = row_sq the rows'
    mean squared norm, by the delta method (NaN where the rows' own gradients were not taken):
    - R: its variance over the rows drawn (`row_sq_var`, measured from their spread);
    - |G|² = ḡ¹·ḡ² over the split, two mask draws ḡⁱ = G + eⁱ with Cov(eⁱ) = C: Var = 2 GᵀCG +
      tr(C²) (`cross_var`, measured from the passes' difference slice by slice).
    The two come from separate draws (the rows' masks and the passes' masks)."""
    if not (math.isfinite(row_sq_var) and math.isfinite(cross_var)) or grad_sq <= 0 or trace <= 0:
        return math.nan
    var_grad_sq = max(cross_var, 0.0)
    row_sq = trace + grad_sq
    return row_sq / grad_sq * math.sqrt(max(row_sq_var, 0.0) / row_sq**2 + var_grad_sq / grad_sq**2)


@dataclass(frozen=True)
class Reading:
    """B_simple at one set of weights, pooled over `probes` measurements there, with its standard
    error (NaN: not computable) and a 95% interval on the log scale (its error is skewed: a |G|²
    read low inflates the ratio more than one read high deflates it)."""

    grad_sq: float
    trace_sigma: float
    se: float
    probes: int

    @property
    def b_simple(self) -> float:
        return self.trace_sigma / self.grad_sq if self.grad_sq > 0 else math.nan

    @property
    def interval(self) -> tuple[float, float]:
        b, se = self.b_simple, self.se
        if not (math.isfinite(b) and math.isfinite(se)) or b <= 0:
            return math.nan, math.nan
        spread = math.exp(Z95 * se / b)
        return b / spread, b * spread

    def figures(self) -> dict[str, float]:
        low, high = self.interval
        return {"b_simple": self.b_simple, "b_simple_se": self.se, "b_simple_ci95_low": low,
                "b_simple_ci95_high": high, "grad_sq": self.grad_sq, "trace_sigma": self.trace_sigma,
                "probes": float(self.probes)}


Z95 = 1.959964


def pooled(measures: list[FullSplitMeasure], population: int | None) -> Reading:
    """One reading from several complete measurements at the same weights (the rows' own gradients
    taken): |G|² and tr(Σ) averaged, their variances averaged and divided by the count."""
    values = torch.stack(
        [torch.stack([m.cross.float(), m.half_diff_sq.float(), m.row_sq.float(), m.row_sq_var.float(),  # type: ignore[union-attr]
                      m.cross_var.float()]) for m in measures]  # type: ignore[union-attr]
    ).tolist()
    estimates = [
        per_row_estimate(c, h, r, m.rows, population) for (c, h, r, _, _), m in zip(values, measures, strict=True)
    ]
    n = len(measures)
    g, t = sum(e[0] for e in estimates) / n, sum(e[1] for e in estimates) / n
    row_var, cross_var = sum(v[3] for v in values) / n / n, sum(v[4] for v in values) / n / n
    return Reading(g, t, standard_error(g, t, cross_var, row_var), n)
