"""The probe that measures the noise scale's |G|² at fixed weights, against which the steps' own
gradient norms give tr(Σ) (gns.py has the estimators): the train split's mean gradient, on one
process or split over DDP's ranks. The strategy builds it (strategy.py)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from batchlab.training.gns import MAX_HALF_WINDOW, FullSplitMeasure
from batchlab.training.gns_exact import is_stochastic

# the rows the full-split probe passes over: the whole train split up to this many (beyond it, as
# many drawn afresh each time); per pass, FULL_SPLIT_CHUNK rows at a time (its memory)
FULL_SPLIT_ROWS = 4096
FULL_SPLIT_CHUNK = 1024
# its period, from a cost model fitted in bench_gns (MLP [64, 64], 1 thread): a step over B rows
# costs about (DISPATCH_ROWS + B) rows' worth (~0.39 ms fixed, ~1.9 µs a row), a pass over M rows
# about (DISPATCH_ROWS + M), so measuring every k-th step costs passes·(DISPATCH_ROWS + M) /
# (k·(DISPATCH_ROWS + B)) of the steps' time; k keeps that at FULL_SPLIT_OVERHEAD, half the 10%
# allowed: the windows' bookkeeping adds ~1.5%, and side by side runs scatter by ±5% here
# (params.yaml's 2800 rows, 2 passes: batch 16 every 556th step, 64 every 455th, 512 every
# 169th), never more often than every FULL_SPLIT_MIN_EVERY-th
FULL_SPLIT_OVERHEAD = 0.05
DISPATCH_ROWS = 200
FULL_SPLIT_MIN_EVERY = 5

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def full_split_every(rows: int, batch: int, passes: int) -> int:
    """The full-split probe's period in steps, from the cost model above."""
    cost = passes * (DISPATCH_ROWS + rows) / (FULL_SPLIT_OVERHEAD * (DISPATCH_ROWS + batch))
    return max(FULL_SPLIT_MIN_EVERY, math.ceil(cost))


class FullSplitProbe:
    """|G|² at the current weights from the mean gradient over the train split (up to
    FULL_SPLIT_ROWS rows), taken twice with independent dropout masks: their dot product is
    unbiased for |G|² (the masks' noise cancels; over the whole split the rows' noise is gone), and
    half their squared difference measures the masks' noise. The steps' own gradient norms give
    tr(Σ) (gns.NoiseScale). Every `every`-th step (default `full_split_every` from the step's rows).

    Runs in fp32 outside autocast, leaves the weights' gradients (torch.autograd.grad), the
    buffers (a BatchNorm's running statistics) and the global RNG as it found them, so training
    takes the same steps with or without it. With `rng`
    (the generator the step's dropout drew from, when not the global one: vectorized seeds) its
    masks start from that generator's state, as a separate run's start from the global RNG's."""

    def __init__(
        self, model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, every: int | None = None,
        rng: torch.Generator | None = None, rank: int = 0, world_size: int = 1,
    ) -> None:  # fmt: skip
        self.model, self.loss_fn, self.x, self.y, self.every, self.rng = model, loss_fn, x, y, every, rng
        self.rank, self.world_size = rank, world_size  # DDP: each rank takes every world_size-th row
        self.params = [p for p in model.parameters() if p.requires_grad]  # the live ones
        self.passes = 2 if is_stochastic(model) else 1
        self.rows_per_pass = min(x.shape[0], FULL_SPLIT_ROWS)
        self.draw = torch.Generator(device=x.device).manual_seed(0)  # which rows, when the split is larger
        self.step_rows = 0
        self.phase = 0  # it measures at the steps k with (k - phase) % every == 0

    def once_before_each(self, period: int) -> None:
        """One measurement per `period` steps, its reading complete at each multiple of `period`
        (train.adaptive_batch decides there; the EMA keeps only the latest reading anyway)."""
        self.every, self.step_rows = period, 0
        self.phase = period - max(1, min(period // 2, MAX_HALF_WINDOW))

    def follow_cost_model(self) -> None:
        """Back to `full_split_every`'s period, from the next step's rows."""
        self.every, self.step_rows, self.phase = None, 0, 0

    def after_backward(self, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        if self.every is None:
            self.step_rows += inputs.shape[0]

    def small(self, step: int) -> FullSplitMeasure | None:
        if self.every is None:  # from the first step's (global) rows: the same period every run and rank
            self.every = full_split_every(self.rows_per_pass, self.step_rows * self.world_size, self.passes)
        if (step - self.phase) % self.every:
            return None
        x, y = self.x, self.y
        if x.shape[0] > self.rows_per_pass:  # the same rows on every rank: one generator, one seed
            pick = torch.randperm(x.shape[0], generator=self.draw, device=x.device)[: self.rows_per_pass]
            x, y = x[pick], y[pick]
        rows = x.shape[0]
        x, y = x[self.rank :: self.world_size], y[self.rank :: self.world_size]
        devices = [x.device] if x.device.type == "cuda" else []  # the CPU generator is always restored
        buffers = [b.clone() for b in self.model.buffers()]
        with torch.random.fork_rng(devices=devices):
            if self.rng is not None:  # dropout draws from the global RNG: give it this seed's state
                torch.set_rng_state(self.rng.get_state())
            sums = torch.stack([self._summed_gradient(x, y) for _ in range(self.passes)])
        with torch.no_grad():
            for saved, live in zip(buffers, self.model.buffers(), strict=True):
                live.copy_(saved)
        if self.world_size > 1:  # every rank's share of the rows: one collective every `every` steps
            dist.all_reduce(sums)
        first, second = sums[0] / rows, sums[-1] / rows
        half_diff_sq = (first - second).square().sum() / 2 if self.passes > 1 else torch.zeros((), device=x.device)
        half_window = max(1, min(self.every // 2, MAX_HALF_WINDOW))
        return FullSplitMeasure(torch.dot(first, second), half_diff_sq, rows, half_window)

    def _summed_gradient(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        total: torch.Tensor | None = None
        for start in range(0, x.shape[0], FULL_SPLIT_CHUNK):
            xs, ys = x[start : start + FULL_SPLIT_CHUNK], y[start : start + FULL_SPLIT_CHUNK]
            with torch.enable_grad():  # the loss summed over the chunk's rows
                loss = self.loss_fn(self.model(xs).float(), ys) * xs.shape[0]
                parts = torch.autograd.grad(loss, self.params)
            flat = torch.cat([g.reshape(-1) for g in parts]).float()
            total = flat if total is None else total + flat
        assert total is not None
        return total
