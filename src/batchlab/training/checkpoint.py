"""Resumable training: what a run has learned so far (TrainState) and where it is kept (Checkpoint).

A checkpoint is written by the main rank only, atomically, after every epoch, and used only
when its fingerprint (model + train params + data) matches the run; a damaged one is set aside
with a warning, never fatal: a checkpoint only saves time.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchlab.model import save_torch

log = logging.getLogger(__name__)

# a sharded (FSDP) checkpoint's plain values, in each epoch folder (sharded.py writes it)
SHARDED_META = "meta.pt"


def sharded_folder(checkpoint: Path) -> Path:
    """The sharded checkpoint's folder beside the single-file one: train.pt -> train.dcp."""
    return checkpoint.with_suffix(".dcp")


def latest_epoch(folder: Path) -> Path | None:
    """The newest complete epoch folder of a sharded checkpoint (renamed into place: no .tmp), or None."""
    if not folder.is_dir():
        return None
    done = sorted(p for p in folder.glob("epoch-*") if p.suffix != ".tmp" and (p / SHARDED_META).is_file())
    return done[-1] if done else None


def read_summary(checkpoint: Path) -> dict[str, Any] | None:
    """The fingerprint and TrainState of the checkpoint a run would resume from: the single file,
    else the newest epoch of the sharded folder; None when there is neither. Raises on a torn file."""
    path = checkpoint if checkpoint.is_file() else None
    if path is None:
        newest = latest_epoch(sharded_folder(checkpoint))
        path = newest / SHARDED_META if newest is not None else None
    if path is None:
        return None
    saved = torch.load(path, map_location="cpu", weights_only=True)
    return saved if isinstance(saved, dict) else None


def discard(checkpoint: Path) -> None:
    """Remove a finished training's checkpoint: the file, or the sharded folder beside it."""
    checkpoint.unlink(missing_ok=True)
    shutil.rmtree(sharded_folder(checkpoint), ignore_errors=True)


@dataclass
class TrainState:
    """The loop's progress: plain values only, so a checkpoint loads with weights_only=True."""

    epoch: int = 0
    best_val_loss: float = math.inf
    best_epoch: int = -1
    bad_epochs: int = 0
    # non-finite steps in a row at the end of the last epoch: the guard counts across epochs
    nonfinite_run: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    # val loss every train.eval_every_steps steps (TrainResult.val_curve); a resumed run continues it
    val_curve: list[dict[str, float]] = field(default_factory=list)
    # gns.NoiseScale.state_dict(): its EMAs, so a resumed run continues them instead of restarting
    noise_scale: dict[str, float] = field(default_factory=dict)
    # optimizer steps and examples since step 0 (a batch that changes makes one not the other's multiple)
    steps: int = 0
    examples: int = 0
    # adaptive.BatchSchedule.state_dict(): the batch now and the decisions so far
    batch_schedule: dict[str, Any] = field(default_factory=dict)

    def record(self, row: dict[str, float], nonfinite_run: int) -> bool:
        """Add an epoch's figures; True when its val loss is the best so far (keep its weights)."""
        self.history.append(row)
        self.epoch = int(row["epoch"])
        self.nonfinite_run = nonfinite_run
        if row["val_loss"] < self.best_val_loss - 1e-6:
            self.best_val_loss, self.best_epoch, self.bad_epochs = row["val_loss"], self.epoch, 0
            return True
        self.bad_epochs += 1
        return False

    def should_stop(self, patience: int) -> bool:
        """Early stopping: `patience` epochs without improvement (0 = never)."""
        return 0 < patience <= self.bad_epochs


@dataclass
class Trainee:
    """The objects a checkpoint restores, built fresh from the config."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Any  # LambdaLR, optim.ExamplesSchedule or optim.ConstantRate: state_dict / load_state_dict / step
    scaler: torch.amp.GradScaler
    best_weights: dict[str, torch.Tensor]

    def keep_best(self) -> None:
        self.best_weights = own_tensors(self.model.state_dict())


def own_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies that own their memory: torch.save and deepcopy keep a view's whole storage, and the
    weights of vectorized seeds are views of one tensor holding every seed's."""
    return {k: v.detach().clone() for k, v in state.items()}


@dataclass(frozen=True)
class Checkpoint:
    path: Path | None
    fingerprint: str
    is_main: bool = True

    def restore(self, trainee: Trainee, device: torch.device) -> TrainState | None:
        """Load a matching checkpoint into `trainee`; None (start fresh) when there is none, it is
        another run's, or it is damaged. On None, `trainee` may be partly loaded: rebuild it."""
        saved = self._read(device)
        if saved is None:
            return None
        if saved.get("fingerprint") != self.fingerprint:
            log.info("ignoring %s: it was written for other params or data", self.path)
            return None
        try:
            trainee.model.load_state_dict(saved["best_model"])  # checks the best weights fit too
            trainee.model.load_state_dict(saved["model"])
            trainee.optimizer.load_state_dict(saved["optimizer"])
            trainee.schedule.load_state_dict(saved["schedule"])
            trainee.scaler.load_state_dict(saved["scaler"])
            state = TrainState(**saved["state"])
        except (KeyError, TypeError, ValueError, RuntimeError) as err:  # loaded, but not what save wrote
            self._set_aside(type(err).__name__)
            return None
        trainee.best_weights = saved["best_model"]
        log.info("resuming from %s at epoch %d", self.path, state.epoch)
        return state

    def save(self, trainee: Trainee, state: TrainState) -> None:
        if self.path is None or not self.is_main:
            return
        payload = {
            "fingerprint": self.fingerprint,
            "model": own_tensors(trainee.model.state_dict()),
            "optimizer": trainee.optimizer.state_dict(),
            "schedule": trainee.schedule.state_dict(),
            "scaler": trainee.scaler.state_dict(),
            "best_model": trainee.best_weights,
            "state": asdict(state),
        }
        save_torch(self.path, payload)

    def _read(self, device: torch.device) -> dict[str, Any] | None:
        if self.path is None or not self.path.is_file():
            return None
        try:
            saved = torch.load(self.path, map_location=device, weights_only=True)
        # torch.load raises EOFError, UnpicklingError, RuntimeError... on a truncated or foreign
        # file; whatever it is, start from scratch rather than fail every rerun
        except Exception as err:
            self._set_aside(type(err).__name__)
            return None
        if not isinstance(saved, dict):
            self._set_aside(f"holds a {type(saved).__name__}")
            return None
        return saved

    def _set_aside(self, reason: str) -> None:
        """Move a damaged checkpoint out of the way (kept for inspection) so this and later runs start fresh."""
        if self.path is None or not self.is_main:  # the main rank alone writes checkpoints, and alone moves them
            return
        damaged = self.path.with_name(f"{self.path.name}.damaged")
        with contextlib.suppress(OSError):
            os.replace(self.path, damaged)
        log.warning(
            "checkpoint %s is damaged (%s); moved it to %s, training from the start", self.path, reason, damaged
        )
