"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state split across ranks, and the
sharded checkpoint (torch.distributed.checkpoint, DCP) that saves and restores them.

strategy.py decides when these are used; nothing else imports this module's FSDP parts.

A checkpoint is a folder `train.dcp/` holding one `epoch-NNNN/` per saved epoch: every rank writes
its shards into `epoch-NNNN.tmp/`, rank 0 adds `meta.pt` (fingerprint, loop state, schedule,
scaler: plain values) and renames the folder into place, then removes the older epochs. A folder
without `.tmp` is therefore complete. Tensors are stored with their global shapes, so a
checkpoint saved by N ranks also loads into one unsharded process (DCP reshards on load).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from batchlab.config import ConfigError
from batchlab.model import save_torch
from batchlab.training.checkpoint import SHARDED_META, Trainee, TrainState, latest_epoch

log = logging.getLogger(__name__)


def units(model: nn.Module, classes: tuple[str, ...] = ()) -> list[nn.Module]:
    """The modules sharded one by one, innermost first: every module of the `classes` named
    (train.fsdp_units), or by default each child of the root that holds parameters but the last
    (the MLP: each hidden Linear; the root keeps the output layer)."""
    if classes:
        found = [m for m in model.modules() if type(m).__name__ in classes and m is not model]
        if not found:
            have = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(
                f"train.fsdp_units {list(classes)}: the model has no module of those classes; it has {have}"
            )
        return found[::-1]  # modules() lists a parent before its children
    return [m for m in model.children() if any(True for _ in m.parameters())][:-1]


def shard(
    model: nn.Module, device: torch.device, precision: str, world_size: int, classes: tuple[str, ...] = ()
) -> nn.Module:
    """Shard `model` in place over `world_size` ranks: each of its `units`, then the root. The mesh
    is always built on `device`: given a gloo group on a machine with GPUs, fully_shard has moved
    models to CUDA and crashed (pytorch#132471)."""
    mesh = init_device_mesh(device.type, (world_size,))
    # bf16: parameters all-gathered and computed in bf16, gradients reduced and kept in fp32
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16"
        else MixedPrecisionPolicy()
    )
    for block in units(model, classes):  # one all-gather per block: only one block's full weights live at a time
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """Reduce-scatter gradients in this backward (True) or accumulate them locally (False): no_sync's twin."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)


def grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """The L2 norm of the whole gradient from its shards: local sums of squares, one all-reduce."""
    local = [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for p in params if p.grad is not None]
    squares = torch.stack([g.float().square().sum() for g in local]).sum()
    dist.all_reduce(squares, op=dist.ReduceOp.SUM)
    return squares.sqrt()


class FusedShardedGradScaler(ShardedGradScaler):
    """ShardedGradScaler (found_inf all-reduced, so every rank skips the same steps) for fused
    optimizers: torch 2.13's keeps found_inf as shape [1], which the fused Adam step rejects
    ("output with shape [] doesn't match the broadcast shape [1]"); GradScaler's is a scalar."""

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        return super()._unscale_grads_(optimizer, inv_scale, found_inf.reshape(()), allow_fp16)


def skeleton(model: nn.Module) -> nn.Module:
    """A copy of `model` on the meta device: its structure without memory, to fill with full weights."""
    memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                            for p in model.parameters()}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in model.buffers()})
    return copy.deepcopy(model, memo)


def flat_full(model: nn.Module) -> torch.Tensor:
    """Every parameter of a sharded model in full, flattened in the model's order (a collective:
    each DTensor is all-gathered, so every rank calls it)."""
    full = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    return torch.cat([t.detach().reshape(-1) for t in full])


def gather_full(model: nn.Module, empty: nn.Module, is_main: bool) -> nn.Module:
    """The unsharded model, its full state_dict gathered on rank 0 (a collective: every rank
    calls it). Other ranks get `empty` (meta tensors): any use of it fails instead of being wrong."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main:
        return empty
    plain = empty.to_empty(device="cpu")
    plain.load_state_dict(full)
    return plain


@dataclass(frozen=True)
class ShardedCheckpoint:
    """checkpoint.Checkpoint's twin for sharded training: every rank saves and restores its shards."""

    path: Path | None  # the train.dcp folder
    fingerprint: str
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def restore(self, trainee: Trainee, device: torch.device) -> TrainState | None:
        """Load the newest matching epoch into `trainee` on every rank; None (start fresh) when there
        is none, it is another run's, or any rank could not load it. On None `trainee` may be partly loaded."""
        newest = latest_epoch(self.path) if self.path is not None else None
        state: TrainState | None = None
        failure = None
        try:
            meta = torch.load(newest / SHARDED_META, weights_only=True) if newest is not None else None
            if meta is not None and meta.get("fingerprint") != self.fingerprint:
                log.info("ignoring %s: it was written for other params or data", newest)
            elif meta is not None and newest is not None:
                state = self._load(trainee, newest, meta)
        # a torn or foreign file; DCP raises its CheckpointException (a BaseException) on every rank
        # when any rank failed to read
        except (Exception, CheckpointException) as err:
            failure = type(err).__name__
        if not self._everyone(state is not None, device):  # all ranks resume, or none does
            if failure is not None:  # moved once every rank is done reading it
                self._set_aside(newest, failure)
            return None
        log.info("resuming from %s at epoch %d", newest, state.epoch if state else -1)
        return state

    def _load(self, trainee: Trainee, folder: Path, meta: dict[str, Any]) -> TrainState:
        model_sd, optim_sd = get_state_dict(trainee.model, trainee.optimizer)
        best = copy.deepcopy(trainee.model.state_dict())  # sharded like the model: DCP loads in place
        saved = {"model": model_sd, "optimizer": optim_sd, "best_model": best}
        dcp.load(saved, checkpoint_id=folder, no_dist=self._alone)
        trainee.model.load_state_dict(best)  # checks the best weights fit too
        # DCP loaded into these dicts in place
        set_state_dict(trainee.model, trainee.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        trainee.schedule.load_state_dict(meta["schedule"])
        trainee.scaler.load_state_dict(meta["scaler"])
        trainee.best_weights = best
        return TrainState(**meta["state"])

    def save(self, trainee: Trainee, state: TrainState) -> None:
        """Every rank writes its shards of the model, optimizer and best weights into a new folder;
        rank 0 adds the plain values and renames it into place."""
        if self.path is None:
            return
        final = self.path / f"epoch-{state.epoch:04d}"
        # a .tmp left by a killed run is overwritten: its .metadata, written last, names the shards read
        tmp = final.with_suffix(".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        model_sd, optim_sd = get_state_dict(trainee.model, trainee.optimizer)
        shards = {"model": model_sd, "optimizer": optim_sd, "best_model": trainee.best_weights}
        dcp.save(shards, checkpoint_id=tmp, no_dist=self._alone)
        if self.is_main:  # dcp.save returns once rank 0 wrote .metadata after every rank's shards
            meta = {"fingerprint": self.fingerprint, "state": asdict(state),
                    "schedule": trainee.schedule.state_dict(), "scaler": trainee.scaler.state_dict()}
            save_torch(tmp / SHARDED_META, meta)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in self.path.glob("epoch-*"):
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)

    def _set_aside(self, folder: Path | None, reason: str) -> None:
        """Move a damaged checkpoint out of the way (rank 0 alone) so this and later runs start fresh."""
        if self.path is None or folder is None or not self.is_main:
            return
        damaged = self.path.with_name(f"{self.path.name}.damaged")
        shutil.rmtree(damaged, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.replace(self.path, damaged)
        log.warning("checkpoint %s is damaged (%s); moved it to %s, training from the start", folder, reason, damaged)

    @property
    def _alone(self) -> bool:
        """One process (world size 1): no collectives, and DCP is told so instead of warning each time."""
        return self.world_size == 1 or not dist.is_initialized()

    def _everyone(self, ok: bool, device: torch.device) -> bool:
        if self._alone:
            return ok
        flag = torch.tensor(1 if ok else 0, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())
