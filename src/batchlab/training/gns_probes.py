"""The probes that measure the noise scale's |G|² against the steps' own gradients (gns.py has
the estimators): the train split's mean gradient at fixed weights on one process, one rank's
gradient against the all-reduced one under DDP (a communication hook). Which one runs is the
strategy's choice (strategy.py, through `probe_for`)."""

# no `from __future__ import annotations`: DDP checks a communication hook's annotations at
# runtime, and a string "dist.GradBucket" fails that check

import math
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call, grad

from batchlab.training.gns import MAX_HALF_WINDOW, FullSplitMeasure
from batchlab.training.gns_exact import is_stochastic

# the rows the full-split probe passes over: the whole train split up to this many (beyond it, as
# many drawn afresh each time); per pass, FULL_SPLIT_CHUNK rows at a time (its memory)
FULL_SPLIT_ROWS = 4096
FULL_SPLIT_CHUNK = 1024
# its period, from a cost model fitted in bench_gns (MLP [64, 64], 1 thread): a pass over M rows or a
# step over B costs about (DISPATCH_ROWS + rows) rows' worth (~0.45 ms fixed, ~1.5 µs a row), so
# measuring every k-th step costs passes·(DISPATCH_ROWS + M) / (k·(DISPATCH_ROWS + B)) of the steps;
# k is set to keep that at FULL_SPLIT_OVERHEAD (params.yaml's 2800 rows, 2 passes: batch 16 every
# 246th step, 64 every 213th, 512 every 96th), never more often than every FULL_SPLIT_MIN_EVERY-th.
# bench_gns measured +16% at batch 16 and +20% at 64 (14000 rows): a probe's row costs ~1.9x a
# step's (functorch's grad, the chunks), which this model does not count yet
FULL_SPLIT_OVERHEAD = 0.08
DISPATCH_ROWS = 300
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

    Runs in fp32 outside autocast, leaves the weights' gradients alone (torch.func.grad) and the
    global RNG as it found it, so training takes the same steps with or without it. With `rng`
    (the generator the step's dropout drew from, when not the global one: vectorized seeds) its
    masks start from that generator's state, as a separate run's start from the global RNG's."""

    def __init__(
        self, model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, every: int | None = None,
        rng: torch.Generator | None = None,
    ) -> None:  # fmt: skip
        self.x, self.y, self.every, self.rng = x, y, every, rng
        # views of the live parameters: the optimizer updates them in place
        self.params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
        buffers = dict(model.named_buffers())
        self.passes = 2 if is_stochastic(model) else 1
        self.rows_per_pass = min(x.shape[0], FULL_SPLIT_ROWS)
        self.draw = torch.Generator(device=x.device).manual_seed(0)  # which rows, when the split is larger
        self.step_rows = 0

        def summed_loss(params: dict[str, torch.Tensor], xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
            return loss_fn(functional_call(model, (params, buffers), (xs,)), ys) * xs.shape[0]

        self.gradient = grad(summed_loss)

    def after_backward(self, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        if self.every is None:
            self.step_rows += inputs.shape[0]

    def small(self, step: int, scale_sq: torch.Tensor | float) -> FullSplitMeasure | None:
        if self.every is None:  # from the first step's rows: the same period every run (reproducible)
            self.every = full_split_every(self.rows_per_pass, self.step_rows, self.passes)
        if step % self.every:
            return None
        x, y = self.x, self.y
        if x.shape[0] > self.rows_per_pass:
            pick = torch.randperm(x.shape[0], generator=self.draw, device=x.device)[: self.rows_per_pass]
            x, y = x[pick], y[pick]
        devices = [x.device] if x.device.type == "cuda" else []  # the CPU generator is always restored
        with torch.random.fork_rng(devices=devices):
            if self.rng is not None:  # dropout draws from the global RNG: give it this seed's state
                torch.set_rng_state(self.rng.get_state())
            means = [self._mean_gradient(x, y) for _ in range(self.passes)]
        first, second = means[0], means[-1]
        half_diff_sq = (first - second).square().sum() / 2 if self.passes > 1 else torch.zeros((), device=x.device)
        half_window = max(1, min(self.every // 2, MAX_HALF_WINDOW))
        return FullSplitMeasure(torch.dot(first, second), half_diff_sq, x.shape[0], half_window)

    def _mean_gradient(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        total: torch.Tensor | None = None
        for start in range(0, x.shape[0], FULL_SPLIT_CHUNK):
            parts = self.gradient(self.params, x[start : start + FULL_SPLIT_CHUNK], y[start : start + FULL_SPLIT_CHUNK])
            flat = torch.cat([g.reshape(-1) for g in parts.values()]).float()
            total = flat if total is None else total + flat
        assert total is not None
        return total / x.shape[0]


def probe_for(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, every: int | None = None
) -> FullSplitProbe:
    """One process's probe (with or without accumulation): the train split's mean gradient (of
    `loss_fn`) at fixed weights. DDP's is CommHookProbe. `every`: measure every this many steps
    (default: from the cost model)."""
    return FullSplitProbe(model, loss_fn, x, y, every)


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
