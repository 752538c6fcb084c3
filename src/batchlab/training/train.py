"""The training loop: fit(...) -> TrainResult."""

from __future__ import annotations

import copy
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from batchlab import collector
from batchlab.config import Config, TrainConfig
from batchlab.data import Dataset, Split
from batchlab.model import build_model
from batchlab.tracking import Tracker
from batchlab.training.adaptive import Adapting, BatchSchedule
from batchlab.training.checkpoint import Checkpoint, Trainee, TrainState
from batchlab.training.epochs import (
    EpochSteps,
    NonFiniteError,
    check_finite,
    dropout_seed,
    epoch_order,
    epoch_row,
    epoch_stats,
    likely_cause,
    val_curve_points,
)
from batchlab.training.gns import NoiseScale
from batchlab.training.gns_probes import at_saved_weights
from batchlab.training.optim import make_optimizer, make_schedule, steps_per_epoch
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
    # train.adaptive_batch: its decisions (step, examples, b_noise, from, to, gain, reason)
    batch_schedule: list[dict[str, Any]] = field(default_factory=list)
    # the noise scale at the weights kept (gns_probes.at_saved_weights): B_simple, its standard
    # error and 95% interval, |G|², tr(Σ), the probes pooled; {} where not measured
    noise_at_saved: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """train_summary.json's figures of the run."""
        figures: dict[str, Any] = {"best_epoch": self.best_epoch, "epochs_run": len(self.history),
                                   "stopped_early": self.stopped_early}
        if self.noise_at_saved:
            figures["gns_at_saved_weights"] = self.noise_at_saved
        return figures | ({"batch_schedule": self.batch_schedule} if self.batch_schedule else {})


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
    until: int | None = None,
) -> TrainResult:
    """Train the model of `cfg` on `dataset`; resume from `checkpoint` when it matches the config.
    `until`: stop after that many epochs of the run (its checkpoint is then the run's state there:
    sweep.local_cbs branches from it), without the reading at the saved weights."""
    tc = cfg.train
    tracker = tracker or Tracker()
    n_train = dataset.train.y.shape[0]
    steps = steps_per_epoch(n_train, tc.batch_size)  # the schedule's epochs, in the starting batch's steps
    saved, trainee, state = _resume_or_start(cfg, dataset, strategy, checkpoint, steps)
    noise = NoiseScale(enabled=tc.gns, population=n_train)
    noise.load_state_dict(state.noise_scale)  # a resumed run continues the EMAs
    batches = BatchSchedule.from_config(tc, n_train)
    train = split_tensors(dataset.train, strategy.device)
    net = strategy.setup(trainee.model, noise, F.cross_entropy, probe_every=tc.gns_every, train_rows=train)
    adapt = Adapting.start(batches, noise, tracker, strategy, state, trainee) if batches else None
    x_val, y_val = split_tensors(dataset.val, strategy.device)
    bar = _progress(tc.epochs, state.epoch, strategy.is_main)
    kept: list[tuple[int, torch.Tensor]] = []  # train.curve_weights
    collector.resume()  # everything is loaded (the optimizer's torch._dynamo too): a loop that may run for hours

    for epoch in range(state.epoch, tc.epochs if until is None else min(until, tc.epochs)):
        # checked here, not after the epoch, so a run resumed from the stopping epoch stops too
        if state.should_stop(tc.early_stopping_patience):
            break
        order = epoch_order(tc.seed, epoch, n_train).to(strategy.device)
        torch.manual_seed(dropout_seed(tc.seed, epoch, strategy.rank))
        examples_before = state.examples
        val = (x_val, y_val)
        ran = _epoch(tc, order, net, trainee, strategy, train, val, state, adapt)
        # one host sync per epoch: the step's figures stay on the device until here
        stats = epoch_stats(torch.stack(ran.losses), torch.stack(ran.norms), strategy, state.nonfinite_run)
        examples_at = batches.examples_at if batches else lambda step: step * tc.batch_size
        state.val_curve += val_curve_points(ran.scored, ran.path.then(noise.settle()), examples_at)
        kept += [(step, weights.cpu()) for step, _, weights in ran.scored if weights is not None]
        state.noise_scale = noise.state_dict()
        check_finite(stats, epoch, tc, dataset, strategy)
        val_logits = predict_logits(trainee.model, x_val, strategy)
        lr = float(trainee.optimizer.param_groups[0]["lr"])
        rows = state.examples - examples_before
        row = epoch_row(epoch, stats, val_logits, y_val, rows, ran.seconds, lr, strategy, noise)
        if batches is not None:  # history.csv's batch at the epoch's end, and the schedule's state
            row["batch_size"], state.batch_schedule = float(batches.batch), batches.state_dict()
        if state.record(row, stats.last_nonfinite_run):
            trainee.keep_best()
        if strategy.is_main:
            tracker.log_epoch(row, step=epoch + 1)
            _report(bar, row, tc.epochs)
        saved.save(trainee, state)  # every rank: a sharded checkpoint holds each rank's shards
    if bar is not None:
        bar.close()
    return _result(trainee, state, tc, dataset, strategy, kept, batches, saved_reading=until is None)


def _epoch(
    tc: TrainConfig,
    order: torch.Tensor,
    net: nn.Module,
    trainee: Trainee,
    strategy: Strategy,
    train: tuple[torch.Tensor, torch.Tensor],
    val: tuple[torch.Tensor, torch.Tensor],
    state: TrainState,
    adapt: Adapting | None,
) -> EpochSteps:
    """One epoch's optimizer steps (EpochSteps). Steps take `order`'s rows batch by batch; the rows
    too few for a whole batch wait for the next epoch's order. `state` counts the steps and
    examples across epochs and resumes."""
    net.train()
    done = EpochSteps()
    scoring_seconds = 0.0  # kept out of samples_per_s, as the end-of-epoch validation is
    started = time.perf_counter()
    start, batch = 0, adapt.batches.batch if adapt is not None else tc.batch_size
    while start + batch <= order.shape[0]:
        rows = order[start : start + batch]
        done.norms.append(train_step(net, strategy, trainee.optimizer, train, rows, done.losses))
        trainee.schedule.step()
        start, state.steps, state.examples = start + batch, state.steps + 1, state.examples + batch
        if tc.eval_every_steps and state.steps % tc.eval_every_steps == 0:
            scoring = time.perf_counter()
            weights = strategy.flat_weights(trainee.model) if tc.curve_weights else None
            val_loss = F.cross_entropy(predict_logits(trainee.model, val[0], strategy), val[1])
            done.scored.append((state.steps, val_loss, weights))
            net.train()  # predict_logits left the model in eval mode
            scoring_seconds += time.perf_counter() - scoring
        if adapt is not None and adapt.batches.due(state.steps):
            done.path = done.path.then(adapt.noise.settle())  # a host sync, once per decision
            batch = adapt.decide(state.steps, state.examples, trainee)
    done.seconds = time.perf_counter() - started - scoring_seconds
    return done


def train_step(
    net: nn.Module,
    strategy: Strategy,
    optimizer: torch.optim.Optimizer,
    train: tuple[torch.Tensor, torch.Tensor],
    batch: torch.Tensor,
    losses: list[torch.Tensor],
) -> torch.Tensor:
    """One optimizer step on the train rows `batch` (their indices): each micro-batch's forward and
    backward, its loss appended to `losses` (on the device), then the step. Returns the gradient's
    norm. The loop and the throughput table (throughput.py) time the same step."""
    x_train, y_train = train
    for rows in strategy.micro_batches(net, batch):
        inputs, targets = x_train[rows], y_train[rows]
        with strategy.autocast():
            loss = F.cross_entropy(net(inputs), targets)
        strategy.backward(loss, inputs, targets)
        losses.append(loss.detach())
    return strategy.step(optimizer)


def _result(
    trainee: Trainee,
    state: TrainState,
    tc: TrainConfig,
    dataset: Dataset,
    strategy: Strategy,
    kept: list[Any],
    batches: BatchSchedule | None,
    saved_reading: bool = True,
) -> TrainResult:
    """The best epoch's weights, unwrapped, with the history (and, with `saved_reading`, the noise
    scale read at them); an error when no epoch was finite."""
    if state.best_epoch < 0:  # the weights were never better than "no model": nothing to return
        raise NonFiniteError(
            f"validation loss was never finite in {state.epoch} epochs; {likely_cause(dataset, strategy)}"
        )
    if batches is not None and strategy.is_main:
        log.info("adaptive batch schedule: %s", batches.summary())
    trainee.model.load_state_dict(trainee.best_weights)
    probe = strategy.probe if saved_reading else None
    saved = at_saved_weights(probe, dataset.train.y.shape[0]) if probe is not None else None
    model = strategy.unwrap(trainee.model).eval()
    return TrainResult(
        model=model,
        history=state.history,
        best_epoch=state.best_epoch,
        stopped_early=len(state.history) < tc.epochs,
        val_curve=state.val_curve,
        curve_weights=kept,
        batch_schedule=batches.decisions if batches is not None else [],
        noise_at_saved=saved.figures() if saved is not None else {},
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
