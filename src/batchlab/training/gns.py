"""The gradient noise scale B_simple = tr(Σ)/|G|², measured while training.

McCandlish, Kaplan et al. 2018, "An Empirical Model of Large-Batch Training", App. A: the
squared norm of a mean gradient over B rows has expectation |G|² + tr(Σ)/B, so squared norms
at two batch sizes give unbiased estimates of |G|² and tr(Σ). One step's estimates are very
noisy (a difference of two close numbers), so each is smoothed by its own EMA and B_simple is
the ratio of the EMAs; a mean of per-step ratios would be biased.

Those formulas assume rows drawn with replacement from an endless stream. A batch here is
drawn without replacement from the N train rows, so its mean's covariance is Σ/B·(N-B)/(N-1):
read through the formulas, that is a |G|² short by tr(Σ)/(N-1), which makes B_simple blow
up as it nears N (25% high at B_simple = N/5). `NoiseScale(population=N)` corrects it exactly:
E|G_B|² = G'² + tr'/B with G'² = |G|² - tr(Σ)/(N-1) and tr' = tr(Σ)·N/(N-1), so the EMAs
estimate G'² and tr', and |G|² = G'² + tr'/N, tr(Σ) = tr'·(N-1)/N (Σ: the covariance of the
per-example gradients over the train rows).

On one process the strategy's probe is gns_probes.FullSplitProbe: |G|² from the train split's
mean gradient at fixed weights, taken twice with independent dropout masks, and tr(Σ) from the
steps' own gradient norms around it (`full_split_estimate`), dropout's noise counted as noise,
as in gns_exact.py; each reading is the latest probe's (FULL_SPLIT_DECAY). Under DDP each rank's
gradient against the all-reduced one (a communication hook), the two-batch form above, with the
long EMA. The small-batch forms (a single row's or a micro-batch's gradient against the step's)
cannot resolve |G|² when B_simple is far above the batch: the default study's B_simple at the
target is ~1600, and a reading from 32 per-example gradients against the batch read 0.06x it.

Cost (benchmarks/bench_gns.py, MLP [64, 64], 1 CPU thread): a probe is two passes over up to
4096 rows, ~9 ms for params.yaml's 2800, so it runs every k-th step with k from a cost model
(gns_probes.full_split_every: batch 16 every 246th step, 512 every 96th); the DDP hook measures
every step (its extra element rides on the all-reduce it replaces).
"""

# no `from __future__ import annotations`: DDP checks a communication hook's annotations at
# runtime, and a string "dist.GradBucket" fails that check

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

import torch

# per measurement. A measurement's estimates scatter by about their mean; the EMA's effective
# sample size is (1 + d) / (1 - d) = 39 measurements (~16% relative error if independent),
# while its memory of ~20 measurements still follows B_simple as it grows over training (it
# rises as the loss falls). Bias correction makes the first measurements usable. On the
# per-example path that memory is ~2000 steps: there B_simple is a long running average.
DECAY = 0.95


def grad_sq_estimate(small_sq: float, big_sq: float, b_small: float, b_big: float) -> float:
    """Unbiased |G|² from the squared norms of mean gradients over b_small and b_big rows."""
    return (b_big * big_sq - b_small * small_sq) / (b_big - b_small)


def trace_estimate(small_sq: float, big_sq: float, b_small: float, b_big: float) -> float:
    """Unbiased tr(Σ) (per-example gradient covariance) from the same two squared norms."""
    return (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)


@dataclass(frozen=True)
class Trajectory:
    """B_simple after each measured step of an epoch, for the val points scored within it."""

    steps: list[int]
    b_simple: list[float]

    def at(self, step: int) -> float:
        """The EMA's B_simple once `step` steps were done (NaN before any measurement)."""
        i = bisect.bisect_right(self.steps, step) - 1
        return self.b_simple[i] if i >= 0 else math.nan


@dataclass(frozen=True)
class FullSplitMeasure:
    """What the full-split probe measured at one step (gns_probes.FullSplitProbe), on the device."""

    cross: torch.Tensor  # ḡ¹·ḡ²: the mean gradients over `rows` rows, two independent dropout draws
    half_diff_sq: torch.Tensor  # |ḡ¹ - ḡ²|² / 2 (0 with one pass): the masks' noise, tr(Σ_mask)/rows
    rows: int
    half_window: int = 16  # steps each side of the probe whose norms give tr(Σ)


def full_split_estimate(
    cross: float, half_diff_sq: float, steps_sq: float, rows: int, batch: int, population: int | None
) -> tuple[float, float]:
    """|G|² and tr(Σ) from a full-split measurement and the mean squared norm of the last steps'
    gradients (over `batch` rows each), dropout's noise counted as noise (gns_exact.py):
    E[cross] = |G|² + tr(Σ_rows)·c, E[steps_sq] = |G|² + tr(Σ_rows)·d + tr(Σ_mask)/batch, with
    c = (N-M)/(M(N-1)) and d = (N-B)/(B(N-1)) (0 and 1/B... as N grows: 1/M and 1/B), and
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


# the full-split path: the steps whose gradient norms give tr(Σ), up to half the probe's period
# each side of it (at most MAX_HALF_WINDOW), so every step between probes counts once and a |G|²
# changing steadily over them averages to its value at the probe (the last steps alone read tr(Σ)
# 20-190% high early in training, where |G|² falls fast). One step's |g|² scatters by ~100% (a few
# rows hold most of the gradient): 32 steps leave ~20%, 246 (batch 16) ~7%
MAX_HALF_WINDOW = 128
# ...and its EMA over probes: each measures |G|² at fixed weights over the whole split, so a short
# memory (about two probes) follows the noise scale where it is read
FULL_SPLIT_DECAY = 0.0


@dataclass
class NoiseScale:
    """Bias-corrected EMAs of |G|² and tr(Σ). Measurements stay on the device until `settle`,
    which the loop calls once per epoch (a host sync per step would cost more than measuring)."""

    enabled: bool = True
    population: int | None = None  # rows the batches are drawn from without replacement (None: endless)
    decay: float = field(default_factory=lambda: DECAY)  # read when built: a test can lengthen it
    full_split_decay: float = field(default_factory=lambda: FULL_SPLIT_DECAY)
    steps: int = 0  # optimizer steps seen since step 0 of the run (restored on resume)
    grad_sq_ema: float = 0.0
    trace_ema: float = 0.0
    weight: float = 0.0  # 1 - decay**n over the n finite measurements: the bias correction
    steps_settled: int = 0  # `steps` at the last settle: where the next trajectory starts
    # (step, values on the device, (b_small, b_big) or (rows, batch) of a full-split measurement, full split?)
    _pending: list[tuple[int, torch.Tensor, tuple[int, int], bool]] = field(default_factory=list, repr=False)
    _big_norms: list[torch.Tensor] = field(default_factory=list, repr=False)  # the open window
    _big_carry: tuple[float, int] = (0.0, 0)  # a resumed window: sum of squares and steps before
    _recent: list[torch.Tensor] = field(default_factory=list, repr=False)  # the last MAX_HALF_WINDOW norms
    # full-split measurements waiting for the steps after them: (probe step, [cross, half_diff_sq],
    # (rows, batch), the window's norms so far, steps still to come)
    _open: list[tuple[int, torch.Tensor, tuple[int, int], list[torch.Tensor], int]] = field(
        default_factory=list, repr=False
    )

    def record_step(
        self, big_norm: torch.Tensor, small: tuple[torch.Tensor, int] | FullSplitMeasure | None, b_big: int
    ) -> None:
        """One optimizer step: the norm of its gradient (the mean over b_big rows), and on a
        measured step either the squared norm of a mean gradient over fewer rows, with their count
        (a DDP rank's), or a full-split measurement.

        For the first, |G_big|² of a measurement is the mean over the steps since the previous one:
        the real step's norm comes free every step, and averaging it removes most of the estimates'
        noise when the small side is measured only every k-th step. For the second, the mean
        squared norm of the steps around it (`half_window` each side), so it is complete, and read,
        `half_window` steps later. No tensor op unless measured; nothing here waits for the device."""
        self.steps += 1
        self._big_norms.append(big_norm)
        self._recent = [*self._recent[-(MAX_HALF_WINDOW - 1) :], big_norm]
        self._close_windows(big_norm)
        if small is None:
            return
        if isinstance(small, FullSplitMeasure):
            values = torch.stack([small.cross.float(), small.half_diff_sq.float()])
            before = self._recent[-small.half_window :]
            self._open.append((self.steps, values, (small.rows, b_big), before, small.half_window))
        elif small[1] < b_big:  # one row per step leaves no smaller batch to compare with
            if len(self._big_norms) == 1:  # a probe that measures every step
                big_sq = big_norm.float().square()
            else:
                norms = torch.stack(self._big_norms).float()
                big_sq = torch.dot(norms, norms)
            carry_sq, carry_steps = self._big_carry
            if carry_steps or len(self._big_norms) > 1:
                big_sq = (big_sq + carry_sq) / (len(self._big_norms) + carry_steps)
            values = torch.stack([small[0].float(), big_sq, torch.zeros_like(big_sq)])  # one stack in `settle`
            self._pending.append((self.steps, values, (small[1], b_big), False))
        self._big_norms, self._big_carry = [], (0.0, 0)

    def _close_windows(self, norm: torch.Tensor) -> None:
        """Add a step's norm to the open full-split windows; a full one becomes a measurement."""
        still_open = []
        for step, values, sizes, norms, to_come in self._open:
            norms = [*norms, norm]
            if to_come > 1:
                still_open.append((step, values, sizes, norms, to_come - 1))
                continue
            stacked = torch.stack(norms).float()
            window_sq = (torch.dot(stacked, stacked) / stacked.shape[0]).view(1)
            self._pending.append((self.steps, torch.cat([values, window_sq]), sizes, True))
        self._open = still_open

    def settle(self) -> Trajectory:
        """Fold the measurements since the last call into the EMAs: one host sync."""
        start = Trajectory([self.steps_settled], [self.b_simple])
        pending, self._pending = self._pending, []
        if not pending:
            self.steps_settled = self.steps
            return start
        values = torch.stack([v for _, v, _, _ in pending]).tolist()
        steps, b_simple = list(start.steps), list(start.b_simple)
        for (step, _, sizes, is_full), measured in zip(pending, values, strict=True):
            g, t = self._solve(measured, sizes, is_full)
            if math.isfinite(g) and math.isfinite(t):  # a skipped (non-finite) step measures nothing
                decay = self.full_split_decay if is_full else self.decay
                self.grad_sq_ema = decay * self.grad_sq_ema + (1 - decay) * g
                self.trace_ema = decay * self.trace_ema + (1 - decay) * t
                self.weight = decay * self.weight + (1 - decay)
                steps.append(step)
                b_simple.append(self.b_simple)
        self.steps_settled = self.steps
        return Trajectory(steps, b_simple)

    def _solve(self, values: list[float], sizes: tuple[int, int], full: bool) -> tuple[float, float]:
        """|G|² and tr(Σ) of one measurement."""
        if full:
            cross, half_diff_sq, steps_sq = values
            return full_split_estimate(cross, half_diff_sq, steps_sq, *sizes, self.population)
        (small_sq, big_sq, _), (b_small, b_big) = values, sizes
        g = grad_sq_estimate(small_sq, big_sq, b_small, b_big)  # G'² and tr' (module docstring)
        t = trace_estimate(small_sq, big_sq, b_small, b_big)
        if self.population:
            return g + t / self.population, t * (1.0 - 1.0 / self.population)
        return g, t

    @property
    def grad_sq(self) -> float:
        return self.grad_sq_ema / self.weight if self.weight > 0 else math.nan

    @property
    def trace_sigma(self) -> float:
        return self.trace_ema / self.weight if self.weight > 0 else math.nan

    @property
    def b_simple(self) -> float:
        # |G|² estimates can come out ≤ 0 early on (noise dominates): no defined ratio then
        return self.trace_sigma / self.grad_sq if self.grad_sq > 0 else math.nan

    def metrics(self) -> dict[str, float]:
        """The epoch row's gns.* keys (NaN until defined), none when disabled."""
        if not self.enabled:
            return {}
        return {"gns.b_simple": self.b_simple, "gns.grad_sq": self.grad_sq, "gns.trace_sigma": self.trace_sigma}

    def state_dict(self) -> dict[str, Any]:
        """Plain values for the checkpoint (call after `settle`; reading the open window syncs once).
        With the open window of |G_big|² and the last steps' norms a resumed run measures exactly
        what an unbroken one does."""
        carry_sq, carry_steps = self._big_carry
        if self._big_norms:
            carry_sq += float(torch.stack(self._big_norms).float().square().sum())
        window = {"big_sum": carry_sq, "big_steps": carry_steps + len(self._big_norms)}
        recent = torch.stack(self._recent).float().tolist() if self._recent else []
        waiting = [
            [step, *values.tolist(), *sizes, torch.stack(norms).float().tolist(), to_come]
            for step, values, sizes, norms, to_come in self._open
        ]
        return {"steps": self.steps, "grad_sq_ema": self.grad_sq_ema, "trace_ema": self.trace_ema,
                "weight": self.weight, **window, "recent": recent, "open": waiting}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:  # a fresh run, or a checkpoint from before the noise scale
            return
        self.steps = self.steps_settled = int(state["steps"])
        self.grad_sq_ema, self.trace_ema = float(state["grad_sq_ema"]), float(state["trace_ema"])
        self.weight = float(state["weight"])
        self._big_norms, self._big_carry = [], (float(state["big_sum"]), int(state["big_steps"]))
        self._recent = [torch.tensor(v) for v in state.get("recent", [])]
        self._open = [
            (int(step), torch.tensor([cross, half]), (int(rows), int(batch)), [torch.tensor(v) for v in norms], int(n))
            for step, cross, half, rows, batch, norms, n in state.get("open", [])
        ]
