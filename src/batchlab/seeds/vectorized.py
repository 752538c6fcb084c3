"""Seeds trained together: fit_seeds(...) -> one TrainResult per seed, each what `fit` gives a separate run.

The seeds' models are stacked into one set of [S, ...] tensors (group.py) and trained by one
batched forward and backward per step and one optimizer step (optimizer.py): the MLP's through
hand-written kernels (stacked.py), any other module's through vmap over functional_call
(functional.py; one it cannot take, BatchNorm's for one, trains its seeds one after another with
`fit`, saying why). Each seed keeps what `fit` gives a separate run: its data order, initial
weights and dropout masks (its own generator, drawn as `fit` draws from the global RNG), gradient
norm and non-finite skip, noise scale, val curve, early stopping, history, best weights,
checkpoint (`fit`'s: either path resumes the other's) and tracker. In fp32 on the CPU the MLP's
results equal separate runs within 1e-6, here bit for bit (tests/seeds/test_vectorized.py); other
modules' within 1e-5 (test_vectorized_generic.py: vmap batches some kernels).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from batchlab import collector
from batchlab.config import Config, TrainConfig
from batchlab.data import Dataset
from batchlab.seeds.functional import FunctionalSeeds, why_apart
from batchlab.seeds.group import Seed, SeedGroup
from batchlab.seeds.optimizer import SeedOptimizer
from batchlab.seeds.stacked import StackedModels
from batchlab.tracking import Tracker
from batchlab.training.checkpoint import Checkpoint, TrainState
from batchlab.training.epochs import (
    EpochSteps,
    NonFiniteError,
    Scored,
    check_finite,
    dropout_seed,
    epoch_order,
    epoch_row,
    epoch_stats,
    likely_cause,
    val_curve_points,
)
from batchlab.training.gns import NoiseScale
from batchlab.training.optim import steps_per_epoch
from batchlab.training.strategy import Strategy
from batchlab.training.support import seeds_train_apart
from batchlab.training.train import TrainResult, fingerprint, fit, initial_model, new_trainee, split_tensors
from batchlab.validate import batch_fits

log = logging.getLogger(__name__)


def same_but_seed(cfgs: list[Config]) -> None:
    """Seeds train together only when nothing but train.seed differs, in a setting the path is checked in."""
    if not cfgs:
        raise ValueError("fit_seeds needs at least one config")
    neutral = {c.model_copy(update={"train": c.train.model_copy(update={"seed": 0})}).model_dump_json() for c in cfgs}
    if len(neutral) > 1:
        raise ValueError("fit_seeds trains configs that differ in train.seed only")
    reason = seeds_train_apart(cfgs[0])
    if reason:
        raise ValueError(f"seeds cannot train together: {reason}")


def resumable_epoch(path: Path, fingerprint: str) -> int:
    """The epochs a checkpoint at `path` holds for this fingerprint (0: none, another run's, unreadable)."""
    if not path.is_file():
        return 0
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        return int(saved["state"]["epoch"]) if saved.get("fingerprint") == fingerprint else 0
    except Exception:  # damaged: `Checkpoint.restore` sets it aside, the seed starts over
        return 0


def fit_seeds(
    cfgs: list[Config],
    dataset: Dataset,
    strategy: Strategy,
    trackers: list[Tracker] | None = None,
    checkpoints: list[Path | None] | None = None,
    until: int | None = None,
) -> list[TrainResult]:
    """Train the configs of `cfgs` (equal but for train.seed) together; resume each from its
    checkpoint. `until`: stop after that many epochs, as `fit` does (sweep.local_cbs's base runs)."""
    same_but_seed(cfgs)
    tc = cfgs[0].train
    n_train = dataset.train.y.shape[0]
    steps = steps_per_epoch(n_train, tc.batch_size)
    batch_fits(tc.batch_size, n_train, "train.batch_size")
    trackers = trackers or [Tracker() for _ in cfgs]
    x_train, y_train = split_tensors(dataset.train, strategy.device)
    reason = model_trains_apart(cfgs[0], dataset, strategy)
    if reason is not None:
        log.info("seeds %s train one after another: %s", ", ".join(str(c.train.seed) for c in cfgs), reason)
        paths = checkpoints or [None for _ in cfgs]
        return [fit(c, dataset, strategy, t, p, until) for c, t, p in zip(cfgs, trackers, paths, strict=True)]
    seeds = restore(cfgs, dataset, strategy, steps, trackers, checkpoints)
    group, optimizer = stack(seeds, strategy, (x_train, y_train), steps)
    x_val, y_val = split_tensors(dataset.val, strategy.device)
    first = seeds[0].state.epoch
    collector.resume()  # as in fit: everything is loaded, and a loop that may run for hours starts

    for epoch in range(first, tc.epochs if until is None else min(until, tc.epochs)):
        for seed in seeds:  # checked before the epoch, as `fit` does: a resumed run stops too
            seed.active = seed.active and not seed.state.should_stop(tc.early_stopping_patience)
        if not any(seed.active for seed in seeds):
            break
        orders = torch.stack([epoch_order(s.cfg.train.seed, epoch, n_train) for s in seeds]).to(strategy.device)
        for seed in seeds:
            seed.dropout.manual_seed(dropout_seed(seed.cfg.train.seed, epoch, strategy.rank))
        ran = _epoch(tc, epoch, orders, group, optimizer, (x_train, y_train), (x_val, y_val))
        active = [s for s in seeds if s.active]
        seconds = ran.seconds / len(active)  # shared by the seeds it trained: their epoch_seconds add up to the wall
        logits = group.predict(x_val)
        step_losses, step_norms = torch.stack(ran.losses).view(-1, len(seeds)), torch.stack(ran.norms)
        for i, seed in enumerate(seeds):
            if seed.active:
                mine = [(n, v[i], None if w is None else w[i]) for n, v, w in ran.scored]
                figures = _EpochFigures(step_losses[:, i], step_norms[:, i], mine, seconds)
                _finish_epoch(seed, epoch, figures, logits[i], y_val, optimizer.lr, dataset, strategy)
        optimizer.save_to([seed.trainee for seed in seeds])
        for seed in active:
            if strategy.is_main:
                seed.checkpoint.save(seed.trainee, seed.state)
        log.info("epoch %d/%d, %d seeds: val_loss %s", epoch + 1, tc.epochs, len(active),
                 " ".join(f"{s.state.history[-1]['val_loss']:.4f}" for s in active))
    return [_result(seed, dataset, strategy) for seed in seeds]


def _epoch(
    tc: TrainConfig,
    epoch: int,
    orders: torch.Tensor,
    group: SeedGroup,
    optimizer: SeedOptimizer,
    train: tuple[torch.Tensor, torch.Tensor],
    val: tuple[torch.Tensor, torch.Tensor],
) -> EpochSteps:
    """One epoch's steps of every seed at once, as `fit`'s epoch: the losses (S per step, seed by
    seed), the norms, the val losses scored within it (with every seed's weights, [S, P], under
    train.curve_weights), and its seconds without that scoring."""
    (x_train, y_train), (x_val, y_val) = train, val
    steps = steps_per_epoch(y_train.shape[0], tc.batch_size)
    done = EpochSteps()
    scoring_seconds = 0.0
    started = time.perf_counter()
    n, b = orders.shape[0], tc.batch_size  # each step's rows of every seed, one contiguous row: [steps, S·B]
    by_step = orders[:, : steps * b].view(n, steps, b).transpose(0, 1).reshape(steps, n * b)
    for step in range(steps):  # index_select: x_train[rows]'s rows, at a fraction of advanced indexing's cost
        inputs = x_train.index_select(0, by_step[step]).view(n, b, *x_train.shape[1:])
        targets = y_train.index_select(0, by_step[step]).view(n, b)
        done.losses += group.backward(inputs, targets)
        done.norms.append(group.measure())
        optimizer.step(group.stepping(done.norms[-1]))
        at = epoch * steps + step + 1
        if tc.eval_every_steps and at % tc.eval_every_steps == 0:
            scoring = time.perf_counter()
            logits = group.predict(x_val)
            weights = group.flat_weights() if tc.curve_weights else None
            done.scored.append((at, torch.stack([F.cross_entropy(out, y_val) for out in logits]), weights))
            scoring_seconds += time.perf_counter() - scoring
    done.seconds = time.perf_counter() - started - scoring_seconds
    return done


def stack(
    seeds: list[Seed], strategy: Strategy, train: tuple[torch.Tensor, torch.Tensor], steps: int
) -> tuple[SeedGroup, SeedOptimizer]:
    """The seeds' stacked model and optimizer, holding their trainees' (restored or fresh) state."""
    group: SeedGroup = (StackedModels if seeds[0].cfg.model.is_mlp() else FunctionalSeeds)(seeds, strategy, train)
    optimizer = SeedOptimizer(seeds[0].cfg.train, list(group.weights.values()), [s.params for s in seeds], steps)
    optimizer.load_from([seed.trainee for seed in seeds])
    return group, optimizer


def restore(
    cfgs: list[Config],
    dataset: Dataset,
    strategy: Strategy,
    steps: int,
    trackers: list[Tracker],
    checkpoints: list[Path | None] | None,
) -> list[Seed]:
    """Every seed's trainee and state, from its checkpoint when all of them hold the same epoch."""
    paths = checkpoints or [None for _ in cfgs]
    saved = [
        Checkpoint(path, fingerprint(cfg, dataset), strategy.is_main) for cfg, path in zip(cfgs, paths, strict=True)
    ]
    trainees = [new_trainee(cfg, dataset, strategy, steps) for cfg in cfgs]
    found = [c.path is not None and c.path.is_file() for c in saved]  # restore may move a damaged one
    states = [checkpoint.restore(trainee, strategy.device) for checkpoint, trainee in zip(saved, trainees, strict=True)]
    if len({0 if state is None else state.epoch for state in states}) > 1:
        # one stacked model steps every seed at once: they start from one epoch
        log.warning("the seeds' checkpoints hold different epochs; training every seed of the group from the start")
        states = [None for _ in cfgs]
    seeds: list[Seed] = []
    for cfg, checkpoint, trainee, state, tracker, tried in zip(
        cfgs, saved, trainees, states, trackers, found, strict=True
    ):
        if state is None:  # a restore that failed may have loaded part: build it again
            trainee, state = new_trainee(cfg, dataset, strategy, steps) if tried else trainee, TrainState()
        noise = NoiseScale(enabled=cfg.train.gns, population=dataset.train.y.shape[0])
        noise.load_state_dict(state.noise_scale)
        seeds.append(Seed(cfg, len(seeds), trainee, state, checkpoint, tracker, noise, torch.Generator()))
    return seeds


@dataclass(frozen=True)
class _EpochFigures:
    """One seed's figures of an epoch, still on the device."""

    losses: torch.Tensor  # per step
    norms: torch.Tensor  # per step
    scored: list[Scored]  # (global step, val loss, weights)
    seconds: float  # its share of the group's time


# a seed trained in a group logs its speed as its share of the group's epoch (the group's wall time
# over the seeds it trained), under names of their own: not the speed of this seed trained alone
GROUP_SHARE = {"samples_per_s": "samples_per_s_group_share", "epoch_seconds": "epoch_seconds_group_share"}


def _finish_epoch(
    seed: Seed,
    epoch: int,
    figures: _EpochFigures,
    val_logits: torch.Tensor,
    y_val: torch.Tensor,
    lr: float,
    dataset: Dataset,
    strategy: Strategy,
) -> None:
    """The epoch's row of one seed, recorded as `fit` records it."""
    tc, state, noise = seed.cfg.train, seed.state, seed.noise
    stats = epoch_stats(figures.losses.contiguous(), figures.norms.contiguous(), strategy, state.nonfinite_run)
    state.val_curve += val_curve_points(figures.scored, noise.settle(), lambda step: step * tc.batch_size)
    seed.curve_weights += [(step, weights.cpu()) for step, _, weights in figures.scored if weights is not None]
    state.noise_scale = noise.state_dict()
    check_finite(stats, epoch, tc, dataset, strategy, who=f"seed {tc.seed}: ")
    steps, seconds = figures.losses.shape[0], figures.seconds
    state.steps, state.examples = state.steps + steps, state.examples + steps * tc.batch_size  # as fit counts
    row = epoch_row(epoch, stats, val_logits, y_val, steps * tc.batch_size, seconds, lr, strategy, noise)
    if state.record(row, stats.last_nonfinite_run):
        seed.trainee.keep_best()
    seed.tracker.log_epoch({GROUP_SHARE.get(k, k): v for k, v in row.items()}, step=epoch + 1)


def _result(seed: Seed, dataset: Dataset, strategy: Strategy) -> TrainResult:
    state = seed.state
    if state.best_epoch < 0:
        raise NonFiniteError(
            f"seed {seed.cfg.train.seed}: validation loss was never finite in {state.epoch} epochs; "
            f"{likely_cause(dataset, strategy)}"
        )
    model = seed.trainee.model
    for param in model.parameters():  # its own memory again: saved alone, it must not carry the other seeds'
        param.data, param.grad = param.data.clone(), None
    model.load_state_dict(seed.trainee.best_weights)
    model.eval()
    return TrainResult(
        model=model,
        history=state.history,
        best_epoch=state.best_epoch,
        stopped_early=len(state.history) < seed.cfg.train.epochs,
        val_curve=state.val_curve,
        curve_weights=seed.curve_weights,
    )


def sweep_trains_apart(cfg: Config, dataset: Callable[[], Dataset]) -> str | None:
    """Why a sweep's seeds (its experiments', its local-CBS branches') train one after another: vectorize_seeds
    off, one seed, a fixed row's config's reasons (train.adaptive_batch is `batchlab train`'s), the model's."""
    if not cfg.sweep.vectorize_seeds or len(cfg.sweep.seeds) < 2:
        return "sweep.vectorize_seeds is false" if not cfg.sweep.vectorize_seeds else "one seed"
    reason = seeds_train_apart(cfg.model_copy(update={"train": cfg.train.model_copy(update={"adaptive_batch": False})}))
    if reason is None and not cfg.model.is_mlp():
        reason = model_trains_apart(cfg, dataset(), Strategy(torch.device("cpu")))
    return reason


def model_trains_apart(cfg: Config, dataset: Dataset, strategy: Strategy) -> str | None:
    """Why the seeds of this model cannot train together (functional.why_apart, tried on an untrained
    model and a batch of the train rows), or None; the MLP's kernels take every built-in MLP."""
    if cfg.model.is_mlp():
        return None
    with torch.random.fork_rng(devices=[]):  # initial_model seeds the global RNG
        model = initial_model(cfg, dataset.input_shape, dataset.n_classes, dataset.vocab).to(strategy.device)
    reason = why_apart(model.train(), torch.from_numpy(dataset.train.x[: cfg.train.batch_size]).to(strategy.device))
    model_key = f"model.factory {cfg.model.factory}" if cfg.model.factory else f"model.name {cfg.model.name}"
    return None if reason is None else f"{model_key}: {reason}"


def epochs_to_resume(cfgs: list[Config], dataset: Dataset, checkpoints: list[Path]) -> list[int]:
    """Each seed's resumable epoch, so a caller can group seeds that start from the same one."""
    return [resumable_epoch(path, fingerprint(cfg, dataset)) for cfg, path in zip(cfgs, checkpoints, strict=True)]
