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

Where the two batch sizes come from is the strategy's choice (strategy.py); the probes here
are its three ways: per-example gradients (torch.func), the micro-batches of gradient
accumulation, and a DDP communication hook (each rank's gradient vs the all-reduced one).

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
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils import get_total_norm

# per measurement. A measurement's estimates scatter by about their mean; the EMA's effective
# sample size is (1 + d) / (1 - d) = 39 measurements (~16% relative error if independent),
# while its memory of ~20 measurements still follows B_simple as it grows over training (it
# rises as the loss falls). Bias correction makes the first measurements usable. On the
# per-example path that memory is ~2000 steps: there B_simple is a long running average.
DECAY = 0.95
# rows whose per-example gradients are taken; a call's cost hardly depends on it (dispatch-bound)
PER_EXAMPLE_ROWS = 32
# measure every k-th step: the per-example probe's call costs 4-5 small steps (module docstring),
# so 1 in 100 keeps it to ~5% of step time at batch 16 (1 in 64 measured 8-14% there, under
# a neighbour's load); the micro-batch probe's two ops per micro-batch cost ~15% of a small
# accumulated step when run every step (6-11% every 2nd step, under load)
PER_EXAMPLE_EVERY = 100
# ...but a short run at a large batch has few steps (batch 512, 20 epochs of 2800 rows: 100):
# measure once per this many trained rows instead when that is more often (batch 256: every
# 50th step, 512: every 25th), never more often than every PER_EXAMPLE_MIN_EVERY-th. The probe
# costs ~1.8 ms there, 1.3x a batch-512 step: every 25th keeps it near 5% (bench_gns)
PER_EXAMPLE_ROWS_BETWEEN = 12800
PER_EXAMPLE_MIN_EVERY = 5
MICRO_BATCH_EVERY = 4

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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


class PerExampleProbe:
    """B_small = 1: the mean over (up to PER_EXAMPLE_ROWS of) the step's rows of |g_i|², from
    vmap(grad) on a functional copy of the model, every `every`-th step (by default from the
    batch: PER_EXAMPLE_ROWS_BETWEEN rows apart, at most PER_EXAMPLE_EVERY steps).
    Runs in fp32 outside autocast and leaves the global RNG (dropout in the real step) as it
    found it, so training takes the same steps with or without it. With `rng` (the generator the
    step's dropout drew from, when not the global one: vectorized seeds) its masks start from
    that generator's state, as a separate run's start from the global RNG's."""

    def __init__(
        self, model: nn.Module, loss_fn: LossFn, every: int | None = None, rng: torch.Generator | None = None
    ) -> None:
        self.model, self.every, self.rng = model, every, rng
        # views of the live parameters: the optimizer updates them in place
        self.params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
        self.buffers = dict(model.named_buffers())
        self.inputs: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []

        def one_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out = functional_call(model, (params, self.buffers), (x.unsqueeze(0),))
            return loss_fn(out, y.unsqueeze(0))

        # randomness="different": each example draws its own dropout mask, as in a real batch
        self.per_example_grads = vmap(grad(one_loss), in_dims=(None, 0, 0), randomness="different")

    def after_backward(self, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.inputs.append(inputs)
        self.targets.append(targets)

    def small(self, step: int, scale_sq: torch.Tensor | float) -> tuple[torch.Tensor, int] | None:
        inputs, targets = self.inputs, self.targets
        self.inputs, self.targets = [], []
        if self.every is None:  # from the first step's rows: the same period every run (reproducible)
            by_rows = max(PER_EXAMPLE_MIN_EVERY, math.ceil(PER_EXAMPLE_ROWS_BETWEEN / sum(x.shape[0] for x in inputs)))
            self.every = min(PER_EXAMPLE_EVERY, by_rows)
        if step % self.every:
            return None
        x, y = torch.cat(inputs)[:PER_EXAMPLE_ROWS], torch.cat(targets)[:PER_EXAMPLE_ROWS]  # rows are shuffled
        devices = [x.device] if x.device.type == "cuda" else []  # the CPU generator is always restored
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            if self.rng is not None:  # vmap's dropout draws from the global RNG: give it this seed's state
                torch.set_rng_state(self.rng.get_state())
            grads = self.per_example_grads(self.params, x, y)
        # mean_i |g_i|² = (sum over every example and parameter of g²) / rows: one foreach norm
        return get_total_norm(list(grads.values())).float().square() / x.shape[0], 1


class MicroBatchProbe:
    """B_small = the micro-batch: each micro-batch's gradient is what its backward added to the
    flat gradient buffer, in the units of the scaled, 1/n-divided loss. Every `every`-th step
    (MICRO_BATCH_EVERY)."""

    def __init__(self, flat_grads: torch.Tensor, micro_batches: int, every: int | None = None) -> None:
        self.flat, self.micro_batches, self.every = flat_grads, micro_batches, every or MICRO_BATCH_EVERY
        self.before = torch.zeros_like(flat_grads)  # the buffer after the previous micro-batch
        self.norms: list[torch.Tensor] = []
        self.rows = 0

    def after_backward(self, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.rows = inputs.shape[0]
        if step % self.every:
            return
        first, last = not self.norms, len(self.norms) == self.micro_batches - 1
        # |what this backward added|: the buffer starts each step at zero
        self.norms.append(torch.linalg.vector_norm(self.flat) if first else torch.dist(self.flat, self.before))
        if not last:
            self.before.copy_(self.flat)

    def small(self, step: int, scale_sq: torch.Tensor | float) -> tuple[torch.Tensor, int] | None:
        if not self.norms:
            return None
        norms, self.norms = torch.stack(self.norms), []
        # backward divided each micro-batch's loss by their count n and multiplied it by the
        # loss scale: mean_m |g_m|² = sum_m norm_m² * n² / n / scale²
        return torch.dot(norms, norms) * (len(norms) / scale_sq), self.rows


class CommHookProbe:
    """B_small = one rank's rows: a DDP communication hook squares each rank's local bucket
    gradient before the all-reduce and averages those squares over the ranks in the same
    all-reduce (one element appended to the bucket), so it adds no collective."""

    def __init__(self, ddp: nn.parallel.DistributedDataParallel, world_size: int) -> None:
        self.world_size = world_size
        self.local_sq: list[torch.Tensor] = []
        self.lock = threading.Lock()  # gloo may finish buckets on its own threads
        self.rows = 0
        ddp.register_comm_hook(self, _mean_with_local_sq)

    def after_backward(self, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.rows += inputs.shape[0]

    def small(self, step: int, scale_sq: torch.Tensor | float) -> tuple[torch.Tensor, int] | None:
        with self.lock:
            sq, self.local_sq = self.local_sq, []
        rows, self.rows = self.rows, 0
        return (torch.stack(sq).sum() / scale_sq, rows) if sq else None


def _mean_with_local_sq(probe: CommHookProbe, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's allreduce hook (divide, then SUM: gloo lacks AVG on older torch) with this rank's
    squared gradient norm riding along as the bucket's last element."""
    buffer = bucket.buffer()
    packed = torch.cat([buffer, torch.dot(buffer, buffer).view(1)]).div_(probe.world_size)
    work = dist.all_reduce(packed, op=dist.ReduceOp.SUM, async_op=True)
    assert work is not None

    def unpack(fut: torch.futures.Future[Any]) -> torch.Tensor:
        reduced = fut.value()[0]
        buffer.copy_(reduced[:-1])
        with probe.lock:
            probe.local_sq.append(reduced[-1].float())  # this bucket's share of mean_r |g_r|²
        return buffer

    return work.get_future().then(unpack)
