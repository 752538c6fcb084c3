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

Where the two batch sizes come from is the strategy's choice (strategy.py); the probes in
gns_probes.py are its three ways: per-example gradients (torch.func), the micro-batches of
gradient accumulation, and a DDP communication hook (each rank's gradient vs the all-reduced one).

Cost (benchmarks/bench_gns.py, MLP [64, 64], 1 CPU thread): vmap(grad) costs a fixed ~1.5 ms
a call, 4-5 steps' time at batch 16-64, so the per-example probe measures every 100th step at
small batches and every 12800 rows at large ones (batch 512: every 25th step); every step would
be +400%. The micro-batch probe measures every 4th step; the DDP hook every
step (its extra element rides on the all-reduce it replaces).
"""

# no `from __future__ import annotations`: DDP checks a communication hook's annotations at
# runtime, and a string "dist.GradBucket" fails that check

import bisect
import math
from dataclasses import dataclass, field

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


@dataclass
class NoiseScale:
    """Bias-corrected EMAs of |G|² and tr(Σ). Measurements stay on the device until `settle`,
    which the loop calls once per epoch (a host sync per step would cost more than measuring)."""

    enabled: bool = True
    population: int | None = None  # rows the batches are drawn from without replacement (None: endless)
    decay: float = field(default_factory=lambda: DECAY)  # read when built: a test can lengthen it
    steps: int = 0  # optimizer steps seen since step 0 of the run (restored on resume)
    grad_sq_ema: float = 0.0
    trace_ema: float = 0.0
    weight: float = 0.0  # 1 - decay**n over the n finite measurements: the bias correction
    steps_settled: int = 0  # `steps` at the last settle: where the next trajectory starts
    _pending: list[tuple[int, torch.Tensor, torch.Tensor, int, int]] = field(default_factory=list, repr=False)
    _big_norms: list[torch.Tensor] = field(default_factory=list, repr=False)  # the open window
    _big_carry: tuple[float, int] = (0.0, 0)  # a resumed window: sum of squares and steps before

    def record_step(self, big_norm: torch.Tensor, small: tuple[torch.Tensor, int] | None, b_big: int) -> None:
        """One optimizer step: the norm of its gradient (the mean over b_big rows), and on a
        measured step the squared norm of a mean gradient over fewer rows, with their count.

        |G_big|² of a measurement is the mean over the steps since the previous one: the real
        step's norm comes free every step, and averaging it removes most of the estimates' noise
        when the small side is measured only every k-th step (the lag, k/2 steps, is far below
        the EMA's). No tensor op unless measured (each costs ~1% of a small step); nothing here
        waits for the device."""
        self.steps += 1
        self._big_norms.append(big_norm)
        if small is None:
            return
        if small[1] < b_big:  # one row per step leaves no smaller batch to compare with
            if len(self._big_norms) == 1:  # a probe that measures every step
                big_sq = big_norm.float().square()
            else:
                norms = torch.stack(self._big_norms).float()
                big_sq = torch.dot(norms, norms)
            carry_sq, carry_steps = self._big_carry
            if carry_steps or len(self._big_norms) > 1:
                big_sq = (big_sq + carry_sq) / (len(self._big_norms) + carry_steps)
            self._pending.append((self.steps, small[0].float(), big_sq, small[1], b_big))
        self._big_norms, self._big_carry = [], (0.0, 0)

    def settle(self) -> Trajectory:
        """Fold the measurements since the last call into the EMAs: one host sync."""
        start = Trajectory([self.steps_settled], [self.b_simple])
        pending, self._pending = self._pending, []
        if not pending:
            self.steps_settled = self.steps
            return start
        values = torch.stack([torch.stack([s, b]) for _, s, b, _, _ in pending]).tolist()
        steps, b_simple = list(start.steps), list(start.b_simple)
        for (step, _, _, b_small, b_big), (small_sq, big_sq) in zip(pending, values, strict=True):
            g = grad_sq_estimate(small_sq, big_sq, b_small, b_big)
            t = trace_estimate(small_sq, big_sq, b_small, b_big)
            if math.isfinite(g) and math.isfinite(t):  # a skipped (non-finite) step measures nothing
                self.grad_sq_ema = self.decay * self.grad_sq_ema + (1 - self.decay) * g
                self.trace_ema = self.decay * self.trace_ema + (1 - self.decay) * t
                self.weight = self.decay * self.weight + (1 - self.decay)
                steps.append(step)
                b_simple.append(self.b_simple)
        self.steps_settled = self.steps
        return Trajectory(steps, b_simple)

    @property
    def grad_sq(self) -> float:
        if self.weight <= 0:
            return math.nan
        extra = self.trace_ema / self.population if self.population else 0.0  # module docstring
        return (self.grad_sq_ema + extra) / self.weight

    @property
    def trace_sigma(self) -> float:
        if self.weight <= 0:
            return math.nan
        finite = 1.0 - 1.0 / self.population if self.population else 1.0
        return self.trace_ema * finite / self.weight

    @property
    def b_simple(self) -> float:
        # |G|² estimates can come out ≤ 0 early on (noise dominates): no defined ratio then
        return self.trace_sigma / self.grad_sq if self.grad_sq > 0 else math.nan

    def metrics(self) -> dict[str, float]:
        """The epoch row's gns.* keys (NaN until defined), none when disabled."""
        if not self.enabled:
            return {}
        return {"gns.b_simple": self.b_simple, "gns.grad_sq": self.grad_sq, "gns.trace_sigma": self.trace_sigma}

    def state_dict(self) -> dict[str, float]:
        """Plain values for the checkpoint (call after `settle`; reading the open window syncs once).
        With the open window of |G_big|² a resumed run measures exactly what an unbroken one does."""
        carry_sq, carry_steps = self._big_carry
        if self._big_norms:
            carry_sq += float(torch.stack(self._big_norms).float().square().sum())
        window = {"big_sum": carry_sq, "big_steps": carry_steps + len(self._big_norms)}
        return {"steps": self.steps, "grad_sq_ema": self.grad_sq_ema, "trace_ema": self.trace_ema,
                "weight": self.weight, **window}  # fmt: skip

    def load_state_dict(self, state: dict[str, float]) -> None:
        if not state:  # a fresh run, or a checkpoint from before the noise scale
            return
        self.steps = self.steps_settled = int(state["steps"])
        self.grad_sq_ema, self.trace_ema = float(state["grad_sq_ema"]), float(state["trace_ema"])
        self.weight = float(state["weight"])
        self._big_norms, self._big_carry = [], (float(state["big_sum"]), int(state["big_steps"]))
