"""The training loop: fit(...) -> TrainResult. Nothing else lives here."""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from batchlab.config import Config, TrainConfig
from batchlab.data import Dataset, Split
from batchlab.model import build_model, save_torch
from batchlab.strategy import Strategy
from batchlab.tracking import NullTracker, Tracker

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Gradients stayed NaN/inf for too many consecutive steps, or the val loss was never finite."""


@dataclass
class TrainState:
    """Everything a checkpoint holds beyond model/optimizer: plain values only (weights_only)."""

    epoch: int = 0
    best_val_loss: float = math.inf
    best_epoch: int = -1
    bad_epochs: int = 0
    # non-finite steps in a row at the end of the last epoch: the guard counts across epochs
    nonfinite_run: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


@dataclass
class TrainResult:
    model: nn.Module
    history: list[dict[str, float]]
    best_epoch: int
    stopped_early: bool


def make_optimizer(cfg: TrainConfig, params: Any) -> torch.optim.Optimizer:
    lr = cfg.lr
    # fused kernels: ~1.5-2x faster steps on CPU, and they can skip a non-finite step on device
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, fused=True)
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return cls(params, lr=lr, weight_decay=cfg.weight_decay, fused=True)


def make_schedule(
    cfg: TrainConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int
) -> torch.optim.lr_scheduler.LambdaLR | None:
    """Warmup + cosine, stepped per optimizer step; None for a constant rate (nothing to step)."""
    if cfg.schedule == "constant":
        return None
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


def _tensors(split: Split, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(split.x).to(device), torch.from_numpy(split.y).to(device)


@dataclass(frozen=True)
class EpochStats:
    train_loss: float
    norm_mean: float
    norm_var: float
    nonfinite: int
    worst_nonfinite_run: int
    last_nonfinite_run: int


def _epoch_stats(
    losses: list[torch.Tensor], norms: list[torch.Tensor], strategy: Strategy, run_before: int
) -> EpochStats:
    """Mean train loss over ranks, and the gradient norm's mean/variance over the finite steps.

    Runs of non-finite steps continue the `run_before` steps that ended the previous epoch.
    """
    train_loss = strategy.mean_across_ranks(torch.stack(losses).float().mean()).item()
    norm = torch.stack(norms).float().cpu()
    finite = torch.isfinite(norm)
    ok = norm[finite]
    worst = run = run_before
    for bad in (~finite).tolist():
        run = run + 1 if bad else 0
        worst = max(worst, run)
    return EpochStats(
        train_loss=train_loss,
        norm_mean=ok.mean().item() if ok.numel() else 0.0,
        norm_var=ok.var(unbiased=False).item() if ok.numel() else 0.0,
        nonfinite=int((~finite).sum()),
        worst_nonfinite_run=worst,
        last_nonfinite_run=run,
    )


def _likely_cause(dataset: Dataset, precision: str) -> str:
    """Why training went non-finite: bad inputs if any, otherwise the optimisation."""
    bad = [name for name in ("train", "val") if not np.isfinite(getattr(dataset, name).x).all()]
    if bad:
        return f"the {'/'.join(bad)} inputs contain NaN/inf values: fix the data, then `batchlab generate`"
    return "lower train.lr or use train.precision fp32/bf16" if precision == "fp16" else "lower train.lr"


def _progress(total: int, start: int, enabled: bool) -> Any:
    if enabled and sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, initial=start, desc="train", unit="epoch")
    return None


def initial_model(cfg: Config, n_features: int, n_classes: int) -> nn.Module:
    """The untrained model: the same weights for the same train.seed, whatever else differs."""
    torch.manual_seed(cfg.train.seed)
    return build_model(cfg.model, n_features, n_classes)


def fit(
    cfg: Config,
    dataset: Dataset,
    strategy: Strategy,
    tracker: Tracker | None = None,
    checkpoint: Path | None = None,
) -> TrainResult:
    """Train the model of `cfg` on `dataset`; resume from `checkpoint` when it matches the config."""
    tc = cfg.train
    tracker = tracker or NullTracker()
    n_train = dataset.train.y.shape[0]
    steps = steps_per_epoch(n_train, tc.batch_size)
    if steps == 0:
        raise ValueError(f"train.batch_size ({tc.batch_size}) is larger than the train split ({n_train} rows)")

    def start() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR | None]:
        model = initial_model(cfg, dataset.n_features, dataset.n_classes).to(strategy.device)
        optimizer = make_optimizer(tc, model.parameters())
        return model, optimizer, make_schedule(tc, optimizer, steps)

    model, optimizer, schedule = start()
    state = TrainState()
    best_weights = copy.deepcopy(model.state_dict())
    print_fp = fingerprint(cfg, dataset)
    saved = None if checkpoint is None else _read_checkpoint(checkpoint, strategy)
    if saved is not None and saved.get("fingerprint") != print_fp:
        log.info("ignoring %s: it was written for other params or data", checkpoint)
    elif saved is not None and checkpoint is not None:
        fresh_scaler = strategy.scaler.state_dict()
        try:
            state, best_weights = _restore(saved, model, optimizer, schedule, strategy.scaler)
            log.info("resuming from %s at epoch %d", checkpoint, state.epoch)
        except (KeyError, TypeError, ValueError, RuntimeError) as err:  # loaded, but not what fit writes
            _set_aside(checkpoint, type(err).__name__, strategy)
            model, optimizer, schedule = start()  # some of the checkpoint may have been loaded already
            strategy.scaler.load_state_dict(fresh_scaler)

    net = strategy.wrap(model)
    strategy.prepare(model)
    strategy.reset_peak_memory()
    x_train, y_train = _tensors(dataset.train, strategy.device)
    x_val, y_val = _tensors(dataset.val, strategy.device)
    micro = tc.grad_accum_steps
    bar = _progress(tc.epochs, state.epoch, strategy.is_main)
    stopped_early = False

    for epoch in range(state.epoch, tc.epochs):
        # checked here, not after the epoch, so a run resumed from the stopping epoch stops too
        stopped_early = 0 < tc.early_stopping_patience <= state.bad_epochs
        if stopped_early:
            break
        # seeded per epoch (and per rank for dropout) so a resumed run replays the same numbers
        order = torch.randperm(n_train, generator=torch.Generator().manual_seed(tc.seed * 100_003 + epoch))
        order = order.to(strategy.device)
        torch.manual_seed(tc.seed * 7919 + epoch * 131 + strategy.rank)
        net.train()
        losses: list[torch.Tensor] = []
        norms: list[torch.Tensor] = []
        started = time.perf_counter()
        for step in range(steps):
            rows = strategy.shard(order[step * tc.batch_size : (step + 1) * tc.batch_size])
            for i, chunk in enumerate(rows.chunk(micro) if micro > 1 else (rows,)):
                with strategy.accumulating(net, last_micro_batch=i == micro - 1):
                    with strategy.autocast():
                        loss = F.cross_entropy(net(x_train[chunk]), y_train[chunk])
                    strategy.backward(loss if micro == 1 else loss / micro)
                losses.append(loss.detach())
            norms.append(strategy.step(optimizer))
            if schedule is not None:
                schedule.step()
        # one host sync per epoch: the step's figures stay on the device until here
        stats = _epoch_stats(losses, norms, strategy, state.nonfinite_run)
        seconds = time.perf_counter() - started
        if stats.worst_nonfinite_run >= tc.max_nonfinite_steps:
            raise NonFiniteError(
                f"{stats.worst_nonfinite_run} consecutive steps had non-finite gradients by epoch {epoch + 1} "
                f"(limit train.max_nonfinite_steps={tc.max_nonfinite_steps}); {_likely_cause(dataset, tc.precision)}"
            )
        val_logits = predict_logits(model, x_val, strategy)
        val_loss = F.cross_entropy(val_logits, y_val).item()
        val_acc = (val_logits.argmax(1) == y_val).float().mean().item()
        row: dict[str, float] = {
            "epoch": float(epoch + 1),
            "train_loss": stats.train_loss,
            "val_loss": val_loss,
            "val_accuracy": val_acc,
            "samples_per_s": steps * tc.batch_size / seconds,
            "epoch_seconds": seconds,
            "peak_memory_mb": strategy.peak_memory_mb(),
            "grad_norm_mean": stats.norm_mean,
            "grad_norm_var": stats.norm_var,
            "nonfinite_steps": float(stats.nonfinite),
            "lr": float(optimizer.param_groups[0]["lr"]),
        }
        state.history.append(row)
        state.epoch = epoch + 1
        state.nonfinite_run = stats.last_nonfinite_run
        if val_loss < state.best_val_loss - 1e-6:
            state.best_val_loss, state.best_epoch, state.bad_epochs = val_loss, epoch + 1, 0
            best_weights = copy.deepcopy(model.state_dict())
        else:
            state.bad_epochs += 1
        if strategy.is_main:
            tracker.log_epoch(row, step=epoch + 1)
            if checkpoint is not None:
                payload = {
                    "fingerprint": print_fp,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "schedule": None if schedule is None else schedule.state_dict(),
                    "scaler": strategy.scaler.state_dict(),
                    "best_model": best_weights,
                    "state": state.__dict__,
                }
                save_torch(checkpoint, payload)
            _report(bar, row, tc.epochs)
    if bar is not None:
        bar.close()
    if state.best_epoch < 0:  # the weights were never better than "no model": nothing to return
        raise NonFiniteError(
            f"validation loss was never finite in {state.epoch} epochs; {_likely_cause(dataset, tc.precision)}"
        )
    model.load_state_dict(best_weights)
    model.eval()
    return TrainResult(model=model, history=state.history, best_epoch=state.best_epoch, stopped_early=stopped_early)


def _read_checkpoint(path: Path, strategy: Strategy) -> dict[str, Any] | None:
    """The checkpoint's contents; None when there is none, or it is damaged (then it is set aside)."""
    if not path.is_file():
        return None
    try:
        saved = torch.load(path, map_location=strategy.device, weights_only=True)
    # torch.load raises EOFError, UnpicklingError, RuntimeError... on a truncated or foreign file;
    # whatever it is, a checkpoint only saves time: start from scratch rather than fail every rerun
    except Exception as err:
        _set_aside(path, type(err).__name__, strategy)
        return None
    if not isinstance(saved, dict):
        _set_aside(path, f"holds a {type(saved).__name__}", strategy)
        return None
    return saved


def _restore(
    saved: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LambdaLR | None,
    scaler: torch.amp.GradScaler,
) -> tuple[TrainState, dict[str, Any]]:
    """Load a checkpoint of this config into the fresh objects; the state and best weights it holds."""
    model.load_state_dict(saved["best_model"])  # checks the best weights fit too; overwritten next
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    if schedule is not None:
        schedule.load_state_dict(saved["schedule"])
    state = TrainState(**saved["state"])
    scaler.load_state_dict(saved["scaler"])
    return state, saved["best_model"]


def _set_aside(path: Path, reason: str, strategy: Strategy) -> None:
    """Move a damaged checkpoint out of the way (kept for inspection) so this and later runs start fresh."""
    if not strategy.is_main:  # rank 0 alone writes checkpoints, and alone moves them
        return
    damaged = path.with_name(f"{path.name}.damaged")
    with contextlib.suppress(OSError):
        os.replace(path, damaged)
    log.warning("checkpoint %s is damaged (%s); moved it to %s, training from the start", path, reason, damaged)


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
