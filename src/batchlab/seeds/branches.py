"""The seeds' local-CBS branches trained together (sweep.local_cbs): branch_losses(...) -> each
seed's training/branch.branch_loss, the seeds restored from their checkpoints at one point into
one stacked model (vectorized.stack) and stepped at once, as fit_seeds trains them. Each seed
keeps its rows (rows_from), its dropout masks (its own generator, seeded as branch_loss seeds the
global RNG), its optimizer state and the run's lr schedule by examples seen, so its val loss is
its separate branch's: within 1e-6 for the MLP, 1e-5 for any other module (tests)."""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from batchlab.config import Config
from batchlab.data import Dataset
from batchlab.seeds.vectorized import fit_seeds, model_trains_apart, restore, same_but_seed, stack
from batchlab.tracking import Tracker
from batchlab.training.branch import branch_loss, rows_from
from batchlab.training.epochs import dropout_seed
from batchlab.training.gns_exact import batch_coupled, exact_at_weights
from batchlab.training.gns_probes import FullSplitProbe, at_saved_weights
from batchlab.training.optim import scaled_lr, steps_per_epoch, warmup_cosine
from batchlab.training.strategy import Strategy, session
from batchlab.training.train import fit, initial_model, split_tensors


def branch_losses(
    cfgs: list[Config], dataset: Dataset, checkpoints: list[Path], multiplier: int, examples: int
) -> list[float]:
    """Each seed's val loss after `examples` train rows at `multiplier` x train.batch_size from its
    checkpoint (`cfgs` equal but for train.seed, their checkpoints at the same epoch's end): what
    branch_loss gives each alone. A model whose seeds cannot train together branches them one
    after another."""
    same_but_seed(cfgs)
    tc, n_train = cfgs[0].train, int(dataset.train.y.shape[0])
    if model_trains_apart(cfgs[0], dataset, Strategy(torch.device("cpu"))) is not None:  # on the CPU only
        saved = [torch.load(path, map_location="cpu", weights_only=True) for path in checkpoints]
        return [branch_loss(cfg, dataset, s, multiplier, examples) for cfg, s in zip(cfgs, saved, strict=True)]
    batch = multiplier * tc.batch_size
    if examples % batch:
        raise ValueError(f"a branch trains whole batches: {examples} examples do not divide by batch {batch}")
    per_epoch = steps_per_epoch(n_train, tc.batch_size)  # the run's schedule, in its own steps
    warmup, total = int(tc.warmup_epochs * per_epoch), max(1, tc.epochs * per_epoch)
    lr = tc.lr * scaled_lr(1.0, tc.batch_size, batch, cfgs[0].sweep.lr_scaling)
    with session(tc) as strategy:
        trackers = [Tracker() for _ in cfgs]
        seeds = restore(cfgs, dataset, strategy, per_epoch, trackers, list[Path | None](checkpoints))
        epoch, seen = seeds[0].state.epoch, seeds[0].state.examples
        if epoch == 0 or any(seed.state.epoch != epoch for seed in seeds):
            raise ValueError(f"branch_losses: checkpoints {[str(p) for p in checkpoints]} hold no common epoch")
        for seed in seeds:
            seed.noise.enabled = False  # a branch reads no noise scale (the sweep reads it at the point)
            seed.dropout.manual_seed(dropout_seed(seed.cfg.train.seed, epoch, strategy.rank))
        train = split_tensors(dataset.train, strategy.device)
        group, optimizer = stack(seeds, strategy, train, per_epoch)
        orders = torch.stack([rows_from(cfg.train.seed, epoch, n_train, examples) for cfg in cfgs])
        orders = orders.to(strategy.device)
        for start in range(0, examples, batch):
            position = (seen + start) // tc.batch_size  # the run's steps had it trained these rows
            factor = 1.0 if tc.schedule == "constant" else warmup_cosine(position, warmup, total)
            for param_group in optimizer.optimizer.param_groups:  # optimizer.step sets no lr a branch reads
                param_group["lr"] = lr * factor
            rows = orders[:, start : start + batch]
            inputs = train[0].index_select(0, rows.flatten()).view(*rows.shape, *train[0].shape[1:])
            group.backward(inputs, train[1].index_select(0, rows.flatten()).view(rows.shape))
            optimizer.step(group.stepping(group.measure()))
        x_val, y_val = split_tensors(dataset.val, strategy.device)
        return [float(F.cross_entropy(logits, y_val)) for logits in group.predict(x_val)]


def run_to_points(
    cfgs: list[Config], dataset: Dataset, wheres: list[Path], epochs: list[int], ks: list[int], examples: int,
    exact_rows: int,
) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """The seeds' runs (`cfgs`, equal but for train.seed; one alone, or several together through
    fit_seeds) trained on to each epoch in `epochs`, each resumed from where/train.pt where an
    interrupted one left it and its checkpoint kept there (where/epoch-<e>.pt); from each, every
    multiplier's branch of `examples` rows. Per epoch, each seed's figures: examples seen, val loss
    at the point, the branches' val losses (per multiplier), and the exact noise scale there (within
    `exact_rows` train rows) beside the in-training estimator's reading."""
    for epoch in epochs:
        with session(cfgs[0].train) as strategy:
            trained = (
                [fit(cfgs[0], dataset, strategy, checkpoint=wheres[0] / "train.pt", until=epoch)]
                if len(cfgs) == 1
                else fit_seeds(cfgs, dataset, strategy, checkpoints=[w / "train.pt" for w in wheres], until=epoch)
            )
        kept = [where / f"epoch-{epoch}.pt" for where in wheres]
        for where, path in zip(wheres, kept, strict=True):
            shutil.copyfile(where / "train.pt", path)
        losses = [_losses(cfgs, dataset, kept, k, examples) for k in ks]  # per multiplier, per seed
        figures = []
        for i, (exp_cfg, result) in enumerate(zip(cfgs, trained, strict=True)):
            saved = torch.load(kept[i], map_location="cpu", weights_only=True)
            exact, estimate = _noise(exp_cfg, dataset, saved, exact_rows)
            figures.append({"examples": int(saved["state"]["examples"]), "start": float(result.history[-1]["val_loss"]),
                            "losses": [per_k[i] for per_k in losses], "b_simple_exact": exact,
                            "b_simple_estimate": estimate})
        yield epoch, figures


def _losses(cfgs: list[Config], dataset: Dataset, kept: list[Path], k: int, examples: int) -> list[float]:
    """Each seed's val loss after its branch at multiplier `k`: together (branch_losses), or alone."""
    if len(cfgs) > 1:
        return branch_losses(cfgs, dataset, kept, k, examples)
    return [branch_loss(cfgs[0], dataset, torch.load(kept[0], map_location="cpu", weights_only=True), k, examples)]


def _noise(cfg: Config, dataset: Dataset, saved: dict[str, Any], exact_rows: int) -> tuple[float, float]:
    """The exact B_simple at the checkpoint's weights and the in-training estimator's reading there
    (the probe training uses, pooled as at the saved weights): NaN where not computable (beyond
    `exact_rows` train rows, a model whose rows are coupled by batch statistics, or one vmap cannot
    take row by row)."""
    model = initial_model(cfg, dataset.input_shape, dataset.n_classes, dataset.vocab)
    model.load_state_dict(saved["model"])
    if batch_coupled(model) is not None:
        return math.nan, math.nan
    found = exact_at_weights(model, dataset.train) if len(dataset.train.y) <= exact_rows else None
    model.train()  # dropout on, as a training step has it
    x, y = split_tensors(dataset.train, torch.device("cpu"))
    reading = at_saved_weights(FullSplitProbe(model, F.cross_entropy, x, y), x.shape[0])
    return found.b_simple if found else math.nan, reading.b_simple if reading is not None else math.nan
