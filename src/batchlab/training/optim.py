"""The optimizer and the learning-rate schedule a run steps: per optimizer step for a fixed batch,
per example seen for an adaptive one (training/adaptive.py), whose steps change size."""

from __future__ import annotations

import math
from typing import Any

import torch

from batchlab.config import TrainConfig


def make_optimizer(cfg: TrainConfig, params: Any) -> torch.optim.Optimizer:
    lr = cfg.lr
    # fused kernels: ~1.5-2x faster steps on CPU, and they can skip a non-finite step on device
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, fused=True)
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return cls(params, lr=lr, weight_decay=cfg.weight_decay, fused=True)


class ConstantRate:
    """The schedule of a constant learning rate: stepping it does nothing (an adaptive run's
    rescaling at a change of batch still sets the rate)."""

    def __init__(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.optimizer = optimizer
        self.rows = 0

    def step(self) -> None:
        pass

    def rescale(self, factor: float, rows: int) -> None:
        assert self.optimizer is not None, "rescale needs the optimizer"
        for group in self.optimizer.param_groups:
            group["lr"] *= factor
        self.rows = rows

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        pass


def warmup_cosine(position: int, warmup: int, total: int) -> float:
    """The schedule's factor at `position` (optimizer steps done, or examples seen): linear warmup
    over `warmup`, then a cosine to 0 at `total`."""
    if position < warmup:
        return (position + 1) / warmup
    progress = min(1.0, (position - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class ExamplesFactor:
    """warmup_cosine over the examples seen; a callable object, so LambdaLR's state_dict keeps its
    count (and a resumed run continues it)."""

    def __init__(self, rows: int, warmup: int, total: int) -> None:
        self.rows, self.warmup, self.total, self.seen = rows, warmup, total, 0

    def __call__(self, step: int) -> float:
        # the warmup counts this step's rows as LambdaLR counts this step: (step + 1) / warmup,
        # so a batch that never changes gives the per-step schedule's factors exactly
        if self.seen < self.warmup:
            return (self.seen + self.rows) / self.warmup
        return warmup_cosine(self.seen, self.warmup, self.total)


class ExamplesSchedule(torch.optim.lr_scheduler.LambdaLR):
    """Warmup + cosine over examples seen: a change of batch neither stretches nor squeezes it.
    Each step adds the step's rows; `rescale` multiplies the peak rate at a change of batch."""

    def __init__(self, optimizer: torch.optim.Optimizer, rows: int, warmup: int, total: int) -> None:
        self.factor = ExamplesFactor(rows, warmup, total)
        self.started = False  # LambdaLR's own first step() sets the initial rate: no rows seen
        super().__init__(optimizer, self.factor)
        self.started = True

    def step(self, epoch: int | None = None) -> None:
        if self.started:
            self.factor.seen += self.factor.rows
        super().step()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.pop("factor")  # the object itself: LambdaLR keeps its values under lr_lambdas
        return state

    def rescale(self, factor: float, rows: int) -> None:
        self.base_lrs = [lr * factor for lr in self.base_lrs]
        for group in self.optimizer.param_groups:
            group["lr"] *= factor
        self.factor.rows = rows


Schedule = torch.optim.lr_scheduler.LambdaLR | ConstantRate


def make_schedule(cfg: TrainConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int) -> Schedule:
    """Warmup + cosine, stepped per optimizer step (per example seen under train.adaptive_batch),
    or a constant rate."""
    if cfg.schedule == "constant":
        return ConstantRate(optimizer)
    total = max(1, cfg.epochs * steps_per_epoch)
    warmup = int(cfg.warmup_epochs * steps_per_epoch)
    if cfg.adaptive_batch:  # the same curve in examples: the budget of the starting batch's epochs
        b = cfg.batch_size
        return ExamplesSchedule(optimizer, b, warmup * b, total * b)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, warmup, total))


def steps_per_epoch(n_rows: int, batch_size: int) -> int:
    # full global batches only: every step sees exactly batch_size rows, so DDP ranks and
    # accumulation shards stay equal; the remainder changes every epoch with the permutation
    return n_rows // batch_size


def scaled_lr(base_lr: float, base_batch: int, batch: int, rule: str) -> float:
    """The learning rate at `batch`, scaled from `base_lr` at `base_batch` (linear or square-root rule)."""
    ratio = batch / base_batch
    return base_lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]
