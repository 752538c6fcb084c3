"""The training loop: fit(...) -> TrainResult, and the optimizer and schedule it steps."""

from __future__ import annotations

import copy
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector

from batchlab import collector
from batchlab.config import Config, TrainConfig
from batchlab.data import Dataset, Split
from batchlab.model import build_model
from batchlab.tracking import Tracker
from batchlab.training.checkpoint import Checkpoint, Trainee, TrainState
from batchlab.training.epochs import (
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
from batchlab.training.strategy import Strategy
from batchlab.validate import batch_fits

if TYPE_CHECKING:
    from batchlab.training.sharded import ShardedCheckpoint

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    model: nn.Module
    history: list[dict[str, float]]
    best_epoch: int
    stopped_early: bool
    # val loss every train.eval_every_steps steps: step, examples, val_loss, gns.b_simple
    val_curve: list[dict[str, float]] = field(default_factory=list)
    # train.curve_weights: (step, flat weights) at the val points since this process started (not
    # kept in the checkpoint, whose every save would carry them: a resumed run has the later ones)
    curve_weights: list[tuple[int, torch.Tensor]] = field(default_factory=list)


def write_curves(result: TrainResult, val_curve_csv: Path, weights_file: Path) -> None:
    """The val curve (train.eval_every_steps) and the weights at its points (train.curve_weights),
    or neither file where the run kept none: no stale file from an earlier run."""
    from batchlab import atomic
    from batchlab.model import save_torch

    if result.val_curve:
        atomic.write_csv(val_curve_csv, result.val_curve)
    else:
        val_curve_csv.unlink(missing_ok=True)
    if result.curve_weights:
        steps, weights = zip(*result.curve_weights, strict=True)
        save_torch(weights_file, {"steps": list(steps), "weights": torch.stack(weights)})
    else:
        weights_file.unlink(missing_ok=True)


def make_optimizer(cfg: TrainConfig, params: Any) -> torch.optim.Optimizer:
    lr = cfg.lr
    # fused kernels: ~1.5-2x faster steps on CPU, and they can skip a non-finite step on device
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, fused=True)
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return cls(params, lr=lr, weight_decay=cfg.weight_decay, fused=True)


class ConstantRate:
    """The schedule of a constant learning rate: stepping it does nothing."""

    def step(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        pass


Schedule = torch.optim.lr_scheduler.LambdaLR | ConstantRate


def make_schedule(cfg: TrainConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int) -> Schedule:
    """Warmup + cosine, stepped per optimizer step, or a constant rate."""
    if cfg.schedule == "constant":
        return ConstantRate()
    total = max(1, cfg.epochs * steps_per_epoch)
    warmup = int(cfg.warmup_epochs * steps_per_epoch)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def steps_per_epoch(n_rows: int, batch_size: int) -> int:
    # full global batches only: every step sees exactly batch_size rows, so DDP ranks and
    # accumulation shards stay equal; the remainder changes every epoch with the permutation
    return n_rows // batch_size


def fingerprint(cfg: Config, dataset: Dataset) -> str:
    return f"{cfg.section_hash('model', 'train')}-{dataset.content_hash()}"


@torch.no_grad()
def predict_logits(model: nn.Module, x: torch.Tensor, strategy: Strategy, chunk: int = 8192) -> torch.Tensor:
    model.eval()
    with strategy.autocast():
        out = [model(x[i : i + chunk]).float() for i in range(0, x.shape[0], chunk)]
    return torch.cat(out)


def split_tensors(split: Split, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(split.x).to(device), torch.from_numpy(split.y).to(device)


def _progress(total: int, start: int, enabled: bool) -> Any:
    if enabled and sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, initial=start, desc="train", unit="epoch")
    return None


def initial_model(cfg: Config, input_shape: int | tuple[int, ...], n_classes: int, vocab: int = 0) -> nn.Module:
    """The untrained model: the same weights for the same train.seed, whatever else differs."""
    torch.manual_seed(cfg.train.seed)
    return build_model(cfg.model, input_shape, n_classes, vocab)


def _resume_or_start(
    cfg: Config, dataset: Dataset, strategy: Strategy, checkpoint: Path | None, steps: int
) -> tuple[Checkpoint | ShardedCheckpoint, Trainee, TrainState]:
    """The checkpoint, and the model, optimizer and loop state it holds, or a fresh start."""
    tc = cfg.train
    batch_fits(tc.batch_size, dataset.train.y.shape[0], "train.batch_size")
    if strategy.grad_accum_steps != tc.grad_accum_steps:
        raise ValueError(
            f"the strategy accumulates {strategy.grad_accum_steps} micro-batches per step, "
            f"train.grad_accum_steps is {tc.grad_accum_steps}: build it with Strategy.from_config"
        )
    saved = strategy.checkpoint(checkpoint, fingerprint(cfg, dataset))
    trainee, initial_scaler = new_trainee(cfg, dataset, strategy, steps), strategy.scaler.state_dict()
    state = saved.restore(trainee, strategy.device)
    if state is None:  # nothing to resume: a fresh start (a failed restore may have loaded part)
        trainee, state = new_trainee(cfg, dataset, strategy, steps), TrainState()
        strategy.scaler.load_state_dict(initial_scaler)
    return saved, trainee, state


def fit(
    cfg: Config,
    dataset: Dataset,
    strategy: Strategy,
    tracker: Tracker | None = None,
    checkpoint: Path | None = None,
) -> TrainResult:
    """Train the model of `cfg` on `dataset`; resume from `checkpoint` when it matches the config."""
    tc = cfg.train
    tracker = tracker or Tracker()
    n_train = dataset.train.y.shape[0]
    steps = steps_per_epoch(n_train, tc.batch_size)
    saved, trainee, state = _resume_or_start(cfg, dataset, strategy, checkpoint, steps)
    noise = NoiseScale(enabled=tc.gns, population=n_train)
    noise.load_state_dict(state.noise_scale)  # a resumed run continues the EMAs
    train = split_tensors(dataset.train, strategy.device)
    net = strategy.setup(trainee.model, noise, F.cross_entropy, probe_every=tc.gns_every, train_rows=train)
    x_val, y_val = split_tensors(dataset.val, strategy.device)
    bar = _progress(tc.epochs, state.epoch, strategy.is_main)
    kept: list[tuple[int, torch.Tensor]] = []  # train.curve_weights
    collector.resume()  # everything is loaded (the optimizer's torch._dynamo too): a loop that may run for hours

    for epoch in range(state.epoch, tc.epochs):
        # checked here, not after the epoch, so a run resumed from the stopping epoch stops too
        if state.should_stop(tc.early_stopping_patience):
            break
        order = epoch_order(tc.seed, epoch, n_train).to(strategy.device)
        torch.manual_seed(dropout_seed(tc.seed, epoch, strategy.rank))
        losses, norms, scored, seconds = _epoch(tc, epoch, order, net, trainee, strategy, train, (x_val, y_val))
        # one host sync per epoch: the step's figures stay on the device until here
        stats = epoch_stats(torch.stack(losses), torch.stack(norms), strategy, state.nonfinite_run)
        state.val_curve += val_curve_points(scored, noise.settle(), tc.batch_size)
        kept += [(step, weights.cpu()) for step, _, weights in scored if weights is not None]
        state.noise_scale = noise.state_dict()
        check_finite(stats, epoch, tc, dataset, strategy)
        val_logits = predict_logits(trainee.model, x_val, strategy)
        lr = float(trainee.optimizer.param_groups[0]["lr"])
        row = epoch_row(epoch, stats, val_logits, y_val, steps * tc.batch_size, seconds, lr, strategy, noise)
        if state.record(row, stats.last_nonfinite_run):
            trainee.keep_best()
        if strategy.is_main:
            tracker.log_epoch(row, step=epoch + 1)
            _report(bar, row, tc.epochs)
        saved.save(trainee, state)  # every rank: a sharded checkpoint holds each rank's shards
    if bar is not None:
        bar.close()
    return _result(trainee, state, tc, dataset, strategy, kept)


def _epoch(
    tc: TrainConfig,
    epoch: int,
    order: torch.Tensor,
    net: nn.Module,
    trainee: Trainee,
    strategy: Strategy,
    train: tuple[torch.Tensor, torch.Tensor],
    val: tuple[torch.Tensor, torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[Scored], float]:
    """One epoch's optimizer steps: the per-micro-batch losses, per-step gradient norms, the val
    losses scored within it (global step, loss, the weights with train.curve_weights), and its
    seconds without that scoring."""
    (x_train, y_train), steps = train, steps_per_epoch(train[1].shape[0], tc.batch_size)
    net.train()
    losses: list[torch.Tensor] = []
    norms: list[torch.Tensor] = []
    scored: list[Scored] = []
    scoring_seconds = 0.0  # kept out of samples_per_s, as the end-of-epoch validation is
    started = time.perf_counter()
    for step in range(steps):
        for rows in strategy.micro_batches(net, order[step * tc.batch_size : (step + 1) * tc.batch_size]):
            inputs, targets = x_train[rows], y_train[rows]
            with strategy.autocast():
                loss = F.cross_entropy(net(inputs), targets)
            strategy.backward(loss, inputs, targets)
            losses.append(loss.detach())
        norms.append(strategy.step(trainee.optimizer))
        trainee.schedule.step()
        done = epoch * steps + step + 1  # steps since step 0, across epochs and resumes
        if tc.eval_every_steps and done % tc.eval_every_steps == 0:
            scoring = time.perf_counter()
            weights = parameters_to_vector(trainee.model.parameters()).detach().clone() if tc.curve_weights else None
            scored.append((done, F.cross_entropy(predict_logits(trainee.model, val[0], strategy), val[1]), weights))
            net.train()  # predict_logits left the model in eval mode
            scoring_seconds += time.perf_counter() - scoring
    return losses, norms, scored, time.perf_counter() - started - scoring_seconds


def _result(
    trainee: Trainee, state: TrainState, tc: TrainConfig, dataset: Dataset, strategy: Strategy, kept: list[Any]
) -> TrainResult:
    """The best epoch's weights, unwrapped, with the history; an error when no epoch was finite."""
    if state.best_epoch < 0:  # the weights were never better than "no model": nothing to return
        raise NonFiniteError(
            f"validation loss was never finite in {state.epoch} epochs; {likely_cause(dataset, strategy)}"
        )
    trainee.model.load_state_dict(trainee.best_weights)
    model = strategy.unwrap(trainee.model).eval()
    return TrainResult(
        model=model,
        history=state.history,
        best_epoch=state.best_epoch,
        stopped_early=len(state.history) < tc.epochs,
        val_curve=state.val_curve,
        curve_weights=kept,
    )


def new_trainee(cfg: Config, dataset: Dataset, strategy: Strategy, steps: int) -> Trainee:
    """The initial model on the device (sharded under FSDP), its optimizer and schedule, and the strategy's scaler."""
    model = initial_model(cfg, dataset.input_shape, dataset.n_classes, dataset.vocab)
    model = strategy.prepare(model.to(strategy.device))
    optimizer = make_optimizer(cfg.train, model.parameters())
    schedule = make_schedule(cfg.train, optimizer, steps)
    return Trainee(model, optimizer, schedule, strategy.scaler, copy.deepcopy(model.state_dict()))


def _report(bar: Any, row: dict[str, float], epochs: int) -> None:
    text = (
        f"train_loss={row['train_loss']:.4f} val_loss={row['val_loss']:.4f} "
        f"val_acc={row['val_accuracy']:.4f} {row['samples_per_s']:.0f} samples/s"
    )
    if bar is None:
        log.info("epoch %d/%d %s", int(row["epoch"]), epochs, text)
    else:
        bar.set_postfix_str(text)
        bar.update(1)
