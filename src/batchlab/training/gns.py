"""The gradient noise scale B_simple = tr(Σ)/|G|², measured while training.

McCandlish, Kaplan et al. 2018, "An Empirical Model of Large-Batch Training", App. A: the
squared norm of a mean gradient over B rows has expectation |G|² + tr(Σ)/B. Σ here is the
covariance of one row's gradient over the train rows *and* dropout's masks (a step draws a mask
per row, so that noise is the step's too: gns_exact.py, whose exact value the tests hold these
readings to). A batch is drawn without replacement from the N train rows, so only the rows'
part shrinks with the finite population:

    E|g_B|² = |G|² + tr(Σ_rows)·(N-B)/(B(N-1)) + tr(Σ_mask)/B.

The paper's two-batch form (squared norms at a small and a big batch) needs a big batch well
above B_simple to resolve |G|², and B_simple here is near N (the default study's is ~1600 at
the target, of 2800 rows): a reading from 32 rows' per-example gradients against the step's
batch read 0.06x the exact value there. So |G|² is measured at fixed weights instead, from the
train split's mean gradient taken twice with independent masks (gns_probes.FullSplitProbe):
their dot product is unbiased for |G|² (the masks' noise cancels, and over the whole split the
rows' noise is gone), half their squared difference is tr(Σ_mask)/M, and up to 512 rows' own
gradients at the same weights give tr(Σ) (`per_row_estimate`): a reading is complete at its probe,
all of it at one set of weights, which the exact value there checks. (The steps' own gradient
norms around the probe, `full_split_estimate`, still read a measurement without them: they read
tr(Σ) 1.6-3x high for the transformer, whose steps' rows, not yet trained on this epoch, have
larger gradients than a random batch.) Each reading is the latest probe's (DECAY).

Cost (benchmarks/bench_gns.py, MLP [64, 64], 1 CPU thread): a probe is two passes over up to
4096 rows, ~11 ms for params.yaml's 2800, plus the rows' own gradients (~6 batched rows each,
gns_exact's figure), so it runs every k-th step with k from a cost model
(gns_probes.full_split_every: batch 16 every 840th step, 512 every 255th).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from batchlab.training.gns_estimates import (
    FullSplitMeasure,
    full_split_estimate,
    per_row_estimate,
    standard_error,
)

# the EMA over probes: each measures |G|² at fixed weights over the whole split, precise to ~10%,
# while B_simple moves by more than that between probes (it rises as the loss falls): the latest
# probe alone reads it where it is read
DECAY = 0.0
# the steps whose gradient norms give tr(Σ): up to half the probe's period each side of it (at
# most MAX_HALF_WINDOW), so a |G|² changing steadily over them averages to its value at the probe
# (the last steps alone read tr(Σ) 20-190% high early in training, where |G|² falls fast). One
# step's |g|² scatters by ~100% (a few rows hold most of the gradient): 32 steps leave ~20%, 128
# ~10%; the cap keeps a reading's wait short
MAX_HALF_WINDOW = 64


@dataclass(frozen=True)
class Trajectory:
    """B_simple after each completed reading of an epoch, for the val points scored within it."""

    steps: list[int]
    b_simple: list[float]
    # the step whose weights each reading measured (the probe's step - 1; NaN: none yet): a reading
    # completes up to a probe period plus its window after the weights it measured
    measured: list[float] = field(default_factory=list)

    def at(self, step: int) -> float:
        """The reading once `step` steps were done (NaN before any)."""
        i = bisect.bisect_right(self.steps, step) - 1
        return self.b_simple[i] if i >= 0 else math.nan

    def measured_at(self, step: int) -> float:
        """The step whose weights `at(step)`'s reading measured (NaN before any)."""
        i = bisect.bisect_right(self.steps, step) - 1
        return self.measured[i] if 0 <= i < len(self.measured) else math.nan

    def then(self, later: Trajectory) -> Trajectory:
        """This trajectory followed by one read after it."""
        return Trajectory(self.steps + later.steps, self.b_simple + later.b_simple, self.measured + later.measured)


@dataclass
class _Window:
    """A probe's measurement waiting for the steps after it."""

    step: int
    values: torch.Tensor  # [cross, half_diff_sq]
    sizes: tuple[int, int]  # (rows, batch)
    norms: list[torch.Tensor]
    to_come: int


@dataclass
class NoiseScale:
    """Bias-corrected EMAs of |G|² and tr(Σ) over the probe's readings. Measurements stay on the
    device until `settle`, which the loop calls once per epoch (a host sync per step would cost
    more than measuring)."""

    enabled: bool = True
    population: int | None = None  # rows the batches are drawn from without replacement (None: endless)
    decay: float = field(default_factory=lambda: DECAY)  # read when built: a test can lengthen it
    steps: int = 0  # optimizer steps seen since step 0 of the run (restored on resume)
    grad_sq_ema: float = 0.0
    trace_ema: float = 0.0
    weight: float = 0.0  # 1 - decay**n over the n finite readings: the bias correction
    steps_settled: int = 0  # `steps` at the last settle: where the next trajectory starts
    measured_step: float = math.nan  # the step whose weights the latest reading measured
    probes: int = 0  # the probe's measurements so far (the study's clock counts their seconds)
    se: float = math.nan  # the latest reading's standard error (`standard_error`; NaN: none)
    _pending: list[tuple[int, int, torch.Tensor, tuple[int, int]]] = field(default_factory=list, repr=False)
    _recent: deque[torch.Tensor] = field(default_factory=lambda: deque(maxlen=MAX_HALF_WINDOW), repr=False)
    _open: list[_Window] = field(default_factory=list, repr=False)

    def record_step(self, norm: torch.Tensor, measured: FullSplitMeasure | None, batch: int) -> None:
        """One optimizer step: the norm of its gradient (the mean over `batch` rows) and, on a
        measured step, the probe's measurement. One with the rows' own squared gradient norms
        (`row_sq`, the usual case) is complete at once; one without (a forward vmap cannot run) is
        completed by the squared norms of the steps around it (`half_window` each side), so read
        `half_window` steps later. No tensor op unless a window completes; nothing here waits for
        the device."""
        self.steps += 1
        self.probes += measured is not None
        self._recent.append(norm)
        if self._open:
            self._close_windows(norm)
        if measured is not None and measured.row_sq is not None:  # complete now: batch 0 marks it
            nan = torch.full_like(measured.row_sq, math.nan)
            var = measured.row_sq_var if measured.row_sq_var is not None else nan
            cross_var = measured.cross_var if measured.cross_var is not None else nan
            values = torch.stack([measured.cross.float(), measured.half_diff_sq.float(), measured.row_sq.float(),
                                  var.float(), cross_var.float()])
            self._pending.append((self.steps, self.steps - 1, values, (measured.rows, 0)))
        elif measured is not None:
            values = torch.stack([measured.cross.float(), measured.half_diff_sq.float()])
            before = list(self._recent)[-measured.half_window :]
            self._open.append(_Window(self.steps, values, (measured.rows, batch), before, measured.half_window))

    def _close_windows(self, norm: torch.Tensor) -> None:
        """Add a step's norm to the open windows; a full one becomes a reading."""
        for window in self._open:
            window.norms.append(norm)
            window.to_come -= 1
            if window.to_come == 0:
                stacked = torch.stack(window.norms).float()
                steps_sq = (torch.dot(stacked, stacked) / stacked.shape[0]).view(1)
                values = torch.cat([window.values, steps_sq, torch.full_like(steps_sq, math.nan).repeat(2)])
                self._pending.append((self.steps, window.step - 1, values, window.sizes))
        self._open = [w for w in self._open if w.to_come > 0]

    def restart_windows(self) -> None:
        """The batch changed (train.adaptive_batch): the norms of the steps before measure another
        batch's noise, so the open windows go and the next probe's window starts from the change."""
        self._recent.clear()
        self._open = []

    def settle(self) -> Trajectory:
        """Fold the readings completed since the last call into the EMAs: one host sync."""
        start = Trajectory([self.steps_settled], [self.b_simple], [self.measured_step])
        pending, self._pending = self._pending, []
        self.steps_settled = self.steps
        if not pending:
            return start
        values = torch.stack([v for _, _, v, _ in pending]).tolist()
        steps, b_simple, measured = list(start.steps), list(start.b_simple), list(start.measured)
        for (step, at, _, (rows, batch)), (cross, half_diff_sq, squares, var, cross_var) in zip(
            pending, values, strict=True
        ):
            if batch == 0:  # the rows' own gradients at the probe's weights
                g, t = per_row_estimate(cross, half_diff_sq, squares, rows, self.population)
            else:  # the steps' norms around it
                g, t = full_split_estimate(cross, half_diff_sq, squares, rows, batch, self.population)
            if math.isfinite(g) and math.isfinite(t):  # a skipped (non-finite) step measures nothing
                self.se = standard_error(g, t, cross_var, var)
                self.grad_sq_ema = self.decay * self.grad_sq_ema + (1 - self.decay) * g
                self.trace_ema = self.decay * self.trace_ema + (1 - self.decay) * t
                self.weight = self.decay * self.weight + (1 - self.decay)
                self.measured_step = float(at)
                steps.append(step)
                b_simple.append(self.b_simple)
                measured.append(self.measured_step)
        return Trajectory(steps, b_simple, measured)

    @property
    def grad_sq(self) -> float:
        return self.grad_sq_ema / self.weight if self.weight > 0 else math.nan

    @property
    def trace_sigma(self) -> float:
        return self.trace_ema / self.weight if self.weight > 0 else math.nan

    @property
    def b_simple(self) -> float:
        # a |G|² reading can come out ≤ 0 where noise dominates it: no defined ratio then
        return self.trace_sigma / self.grad_sq if self.grad_sq > 0 else math.nan

    def metrics(self) -> dict[str, float]:
        """The epoch row's gns.* keys (NaN until defined), none when disabled."""
        if not self.enabled:
            return {}
        return {"gns.b_simple": self.b_simple, "gns.b_simple_se": self.se, "gns.grad_sq": self.grad_sq,
                "gns.trace_sigma": self.trace_sigma, "gns.probes": float(self.probes)}

    def state_dict(self) -> dict[str, Any]:
        """Plain values for the checkpoint (call after `settle`; reading the windows syncs once):
        with the last steps' norms and the open windows a resumed run measures exactly what an
        unbroken one does."""
        recent = torch.stack(list(self._recent)).float().tolist() if self._recent else []
        waiting = [
            [w.step, *w.values.tolist(), *w.sizes, torch.stack(w.norms).float().tolist(), w.to_come] for w in self._open
        ]
        return {"steps": self.steps, "grad_sq_ema": self.grad_sq_ema, "trace_ema": self.trace_ema,
                "weight": self.weight, "measured_step": self.measured_step, "probes": self.probes, "se": self.se,
                "recent": recent, "open": waiting}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:  # a fresh run, or a checkpoint from before the noise scale
            return
        self.steps = self.steps_settled = int(state["steps"])
        if "recent" not in state:  # an earlier estimator's: its readings start over
            return
        self.grad_sq_ema, self.trace_ema = float(state["grad_sq_ema"]), float(state["trace_ema"])
        self.weight = float(state["weight"])
        self.measured_step = float(state.get("measured_step", math.nan))
        self.probes = int(state.get("probes", 0))
        self.se = float(state.get("se", math.nan))
        self._recent.extend(torch.tensor(v) for v in state["recent"])
        self._open = [
            _Window(
                int(step),
                torch.tensor([cross, half]),
                (int(rows), int(batch)),
                [torch.tensor(v) for v in norms],
                int(n),
            )
            for step, cross, half, rows, batch, norms, n in state["open"]
        ]
