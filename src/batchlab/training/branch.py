"""A branch of a run: from its checkpoint (the resume format: weights, optimizer state, the
schedule's position), train the same examples at another batch and read the val loss after them
(sweep.local_cbs; study/local_cbs.py analyses the branches)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from batchlab.config import Config
from batchlab.data import Dataset
from batchlab.training.epochs import dropout_seed, epoch_order
from batchlab.training.optim import make_optimizer, scaled_lr, steps_per_epoch, warmup_cosine
from batchlab.training.strategy import session
from batchlab.training.train import initial_model, predict_logits, split_tensors, train_step


def rows_from(seed: int, epoch: int, n_rows: int, count: int) -> torch.Tensor:
    """The first `count` train rows of the run's epoch orders from `epoch` on, one after another:
    every branch from a point takes its steps from the same rows, whatever its batch."""
    parts: list[torch.Tensor] = []
    total = 0
    while total < count:
        parts.append(epoch_order(seed, epoch + len(parts), n_rows))
        total += n_rows
    return torch.cat(parts)[:count]


def branch_loss(cfg: Config, dataset: Dataset, saved: dict[str, Any], multiplier: int, examples: int) -> float:
    """The val loss after `examples` train rows at `multiplier` x train.batch_size from the
    checkpoint `saved` (Checkpoint.save's payload, at an epoch's end), the lr scaled by
    sweep.lr_scaling and following the run's schedule by examples seen (so the base branch,
    multiplier 1, steps as the run itself would). One process; the same dropout seed and rows for
    every multiplier, so the branches' differences are the batch's alone."""
    tc = cfg.train
    batch = multiplier * tc.batch_size
    if examples % batch:
        raise ValueError(f"a branch trains whole batches: {examples} examples do not divide by batch {batch}")
    state, n_train = saved["state"], dataset.train.y.shape[0]
    per_epoch = steps_per_epoch(n_train, tc.batch_size)  # the run's schedule, in its own steps
    warmup, total = int(tc.warmup_epochs * per_epoch), max(1, tc.epochs * per_epoch)
    lr = tc.lr * scaled_lr(1.0, tc.batch_size, batch, cfg.sweep.lr_scaling)
    with session(tc) as strategy:
        model = initial_model(cfg, dataset.input_shape, dataset.n_classes, dataset.vocab)
        model.load_state_dict(saved["model"])
        model = strategy.prepare(model.to(strategy.device))
        optimizer = make_optimizer(tc, model.parameters())
        optimizer.load_state_dict(saved["optimizer"])
        net = strategy.setup(model)
        train = split_tensors(dataset.train, strategy.device)
        rows = rows_from(tc.seed, int(state["epoch"]), n_train, examples).to(strategy.device)
        torch.manual_seed(dropout_seed(tc.seed, int(state["epoch"]), strategy.rank))
        seen, losses = int(state["examples"]), list[torch.Tensor]()
        net.train()
        for start in range(0, examples, batch):
            position = (seen + start) // tc.batch_size  # the run's steps had it trained these rows
            factor = 1.0 if tc.schedule == "constant" else warmup_cosine(position, warmup, total)
            for group in optimizer.param_groups:
                group["lr"] = lr * factor
            train_step(net, strategy, optimizer, train, rows[start : start + batch], losses)
        x_val, y_val = split_tensors(dataset.val, strategy.device)
        with torch.no_grad():
            return float(F.cross_entropy(predict_logits(model, x_val, strategy), y_val))
