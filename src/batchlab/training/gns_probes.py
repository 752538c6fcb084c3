"""The probes that give the noise scale its small batch (gns.py has the estimators): single
examples' gradients against the batch on one process, micro-batches against the batch under
accumulation, one rank's gradient against the all-reduced one under DDP (a communication hook).
Which one runs is the strategy's choice (strategy.py, through `probe_for`)."""

# no `from __future__ import annotations`: DDP checks a communication hook's annotations at
# runtime, and a string "dist.GradBucket" fails that check

import math
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils import get_total_norm

# rows whose per-example gradients are taken; a call's cost hardly depends on it (dispatch-bound)
PER_EXAMPLE_ROWS = 32
# measure every k-th step: the per-example probe's call costs 4-5 small steps (gns.py's docstring),
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


def probe_for(
    model: nn.Module, flat_grads: torch.Tensor, micro_batches: int, loss_fn: LossFn, every: int | None = None
) -> PerExampleProbe | MicroBatchProbe:
    """One process's probe: the micro-batches against the batch under accumulation, otherwise
    single examples' gradients (of `loss_fn`) against the batch. DDP's is CommHookProbe.
    `every`: measure every this many steps (default: each probe's own period)."""
    if micro_batches > 1:
        return MicroBatchProbe(flat_grads, micro_batches, every)
    return PerExampleProbe(model, loss_fn, every)


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
