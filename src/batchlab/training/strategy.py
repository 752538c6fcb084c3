"""Device, DDP or FSDP, precision and gradient scaling, decided once.

Every member is safe to call whatever the settings: `autocast()` is a null context in fp32, the scaler
is disabled unless fp16, `prepare` and `setup` return the model itself on one process, `unwrap` returns
what is saved and exported. Outside this module only launch.py (how ranks start) branches on the
strategy; FSDP's parts live in sharded.py, what this machine can run (before any process) in support.py.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import get_total_norm, parameters_to_vector

from batchlab.config import TrainConfig
from batchlab.training import peaks
from batchlab.training.checkpoint import Checkpoint, sharded_folder
from batchlab.training.gns import NoiseScale
from batchlab.training.gns_exact import batch_coupled
from batchlab.training.gns_probes import FullSplitProbe, LossFn
from batchlab.training.support import resolve_device

if TYPE_CHECKING:
    from batchlab.training.sharded import ShardedCheckpoint

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class CollectiveTimeout(RuntimeError):
    """A DDP or FSDP collective waited longer than train.dist_timeout_s."""


@dataclass
class Strategy:
    device: torch.device
    precision: str = "fp32"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    timeout_s: float = 300.0
    grad_accum_steps: int = 1
    sharded: bool = False  # FSDP: fully_shard over the ranks, DCP checkpoints (also on one process)
    fsdp_units: tuple[str, ...] = ()  # train.fsdp_units: the module classes sharded one by one
    scaler: torch.amp.GradScaler = field(init=False)
    _skeleton: nn.Module | None = field(init=False, default=None)  # the unsharded model's shape
    _params: list[nn.Parameter] = field(init=False, default_factory=list)
    _flat_grads: torch.Tensor | None = field(init=False, default=None)
    _noise: NoiseScale | None = field(init=False, default=None)
    probe: FullSplitProbe | None = field(init=False, default=None)  # the noise probe, once set up
    _step_rows: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        fp16 = self.precision == "fp16"
        if self.fsdp and fp16:
            from batchlab.training.sharded import FusedShardedGradScaler  # FSDP's modules: loaded when used

            # every rank must skip the same steps: found_inf of the local shards is all-reduced
            self.scaler = FusedShardedGradScaler(self.device.type)
        else:
            self.scaler = torch.amp.GradScaler(self.device.type, enabled=fp16)

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> Strategy:
        """Single process, or one rank of a group started by torchrun (RANK/WORLD_SIZE set).
        stages.train has run check_supported before starting it."""
        device = resolve_device(cfg)
        world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if world_size > 1:
            if device.type == "cuda":
                torch.cuda.set_device(local_rank)
                device = torch.device("cuda", local_rank)
            if not dist.is_initialized():
                from batchlab.training import loopback

                backend = "nccl" if device.type == "cuda" else "gloo"
                loopback.init_process_group(backend, rank, world_size, dt.timedelta(seconds=cfg.dist_timeout_s))
        return cls(device, cfg.precision, rank, local_rank, world_size, float(cfg.dist_timeout_s),
                   cfg.grad_accum_steps, sharded=cfg.strategy == "fsdp", fsdp_units=tuple(cfg.fsdp_units))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def fsdp(self) -> bool:  # parameters, gradients and optimizer state split across ranks
        return self.sharded and self.is_distributed

    def divergence_hint(self) -> str:  # what to change when the loss went non-finite with clean data
        return "lower train.lr or use train.precision fp32/bf16" if self.precision == "fp16" else "lower train.lr"

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.precision])

    def prepare(self, model: nn.Module) -> nn.Module:
        """The model whose parameters the optimizer is built on: under FSDP sharded in place (the
        optimizer must come after), otherwise `model` itself."""
        if not self.fsdp:
            return model
        from batchlab.training import sharded

        self._skeleton = sharded.skeleton(model)
        return sharded.shard(model, self.device, self.precision, self.world_size, self.fsdp_units)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain model to save and export. Under FSDP its full weights, gathered on rank 0 (every
        rank must call this); the other ranks get a model on the meta device."""
        if not self.fsdp or self._skeleton is None:
            return model
        from batchlab.training import sharded

        return sharded.gather_full(model, self._skeleton, self.is_main)

    def flat_weights(self, model: nn.Module) -> torch.Tensor:
        """The plain model's parameters as one flat copy (FSDP: each shard gathered whole on every rank)."""
        if not self.fsdp:
            return parameters_to_vector(model.parameters()).detach().clone()
        from batchlab.training import sharded

        return sharded.flat_full(model)  # a collective: every rank calls it

    def checkpoint(self, path: Path | None, fingerprint: str) -> Checkpoint | ShardedCheckpoint:
        """Where `fit` resumes from and saves to: one file written by rank 0, or under FSDP a DCP
        folder beside it (train.pt -> train.dcp) that every rank writes its shards into."""
        if not self.sharded:
            return Checkpoint(path, fingerprint, self.is_main)
        from batchlab.training import sharded

        folder = sharded_folder(path) if path is not None else None
        return sharded.ShardedCheckpoint(folder, fingerprint, self.rank, self.world_size)

    def setup(
        self,
        model: nn.Module,
        noise: NoiseScale | None = None,
        loss_fn: LossFn = F.cross_entropy,
        probe_every: int | None = None,
        train_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> nn.Module:
        """Ready `model` (on the device) for training: what the loop calls forward on. One process: every
        gradient a view of one flat buffer, so the norm and the zeroing are one op each (~25% of a small
        model's step). DDP: the wrapped model, which owns its gradient buckets. FSDP: the model `prepare`
        sharded. With an enabled `noise` (not under FSDP), steps also measure the noise scale into it (gns.py;
        FullSplitProbe every `probe_every` steps if given) over `train_rows`, split over DDP's ranks."""
        self.reset_peak_memory()
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._flat_grads = None
        self._noise = noise if noise is not None and noise.enabled else None
        self.probe, self._step_rows = None, 0
        why_not = "under fsdp (its probe would gather every shard)" if self.fsdp else batch_coupled(model)
        if why_not is not None and self._noise is not None:
            if self.is_main:
                log.info("gns: not measured %s; gns.* not logged", why_not)
            self._noise.enabled, self._noise = False, None
        if self.fsdp:
            return model
        if self.is_distributed:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            # gradients as views of DDP's buckets: no copy per step (1.37x -> 1.53x on 2 CPU ranks here)
            ddp = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
            if self._noise is not None:
                assert train_rows is not None, "the noise probe passes over the train rows: give them"
                rank, world = self.rank, self.world_size  # each rank its share of the rows
                self.probe = FullSplitProbe(model, loss_fn, *train_rows, probe_every, rank=rank, world_size=world)
            return ddp
        flat, offset = torch.zeros(sum(p.numel() for p in self._params), device=self.device), 0
        for p in self._params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self._flat_grads = flat
        if self._noise is not None:
            assert train_rows is not None, "the noise probe passes over the train rows: give them"
            self.probe = FullSplitProbe(model, loss_fn, *train_rows, probe_every)
        return model

    def micro_batches(self, net: nn.Module, batch: torch.Tensor) -> Iterator[torch.Tensor]:
        """This rank's rows of a global batch, in grad_accum_steps chunks. DDP all-reduces the
        gradients only in the backward of the last chunk (the others accumulate locally)."""
        rows = batch
        if self.world_size > 1:  # an equal slice per rank: the batch size divides by world size
            per_rank = batch.shape[0] // self.world_size
            rows = batch[self.rank * per_rank : (self.rank + 1) * per_rank]
        if self.grad_accum_steps == 1:
            yield rows
            return
        chunks = rows.chunk(self.grad_accum_steps)
        for i, chunk in enumerate(chunks):
            if isinstance(net, DistributedDataParallel):
                net.require_backward_grad_sync = i == len(chunks) - 1  # what no_sync() sets
            elif self.fsdp:
                from batchlab.training import sharded

                # FSDP: gradients accumulate unsharded locally; one reduce-scatter in the last backward
                sharded.set_gradient_sync(net, i == len(chunks) - 1)
            yield chunk

    def backward(self, loss: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Backward of one micro-batch's mean loss over `inputs`, scaled so the accumulated gradient
        is the step's mean. The noise probe counts the rows (its period follows the batch)."""
        if self.grad_accum_steps > 1:
            loss = loss / self.grad_accum_steps
        self.scaler.scale(loss).backward()
        if self.probe is not None and self._noise is not None:
            self.probe.after_backward(self._noise.steps + 1, inputs, targets)
            self._step_rows += inputs.shape[0]

    def step(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Unscale, measure the gradient norm (and noise scale), step unless non-finite, zero. Returns the norm."""
        self.scaler.unscale_(optimizer)
        if self._flat_grads is not None:
            norm = torch.linalg.vector_norm(self._flat_grads)
        elif self.fsdp:
            from batchlab.training import sharded

            norm = sharded.grad_norm(self._params)  # the same global norm on every rank
        else:
            norm = get_total_norm([p.grad for p in self._params if p.grad is not None])
        self._measure_noise(norm)  # unscaled, before the optimizer changes the weights
        if self.scaler.is_enabled():
            self.scaler.step(optimizer)  # skips non-finite steps itself
            self.scaler.update()
        elif self.device.type == "cuda" and getattr(optimizer, "_step_supports_amp_scaling", False):
            # a fused optimizer skips the step on the GPU: no host sync per step
            optimizer.found_inf = (~torch.isfinite(norm)).float()  # type: ignore[attr-defined]
            optimizer.step()
        elif math.isfinite(norm.item()):  # on the CPU nothing is queued: reading a value costs no sync
            optimizer.step()
        if self._flat_grads is not None:
            self._flat_grads.zero_()
        else:
            optimizer.zero_grad(set_to_none=True)
        return norm

    def _measure_noise(self, norm: torch.Tensor) -> None:
        """Give the noise scale the step's (unscaled) gradient norm and, on a measured step, the
        probe's measurement (on the device)."""
        if self._noise is None or self.probe is None:
            return
        rows, self._step_rows = self._step_rows, 0
        self._noise.record_step(norm, self.probe.small(self._noise.steps + 1), rows * self.world_size)

    def mean_across_ranks(self, values: torch.Tensor) -> torch.Tensor:
        if self.is_distributed:
            values = values.clone()
            dist.all_reduce(values, op=dist.ReduceOp.SUM)
            values /= self.world_size
        return values

    @contextlib.contextmanager
    def collective_errors(self) -> Iterator[None]:
        """Turn a collective that timed out (a rank hung or died) into one clear line."""
        try:
            yield
        except RuntimeError as err:  # torch.distributed.DistBackendError is a RuntimeError
            if not (self.is_distributed and "timed out" in str(err).lower()):
                raise
            raise CollectiveTimeout(
                f"rank {self.rank}: a collective did not finish within train.dist_timeout_s={self.timeout_s:g} s; "
                "another rank is stuck or dead"
            ) from err

    def reset_peak_memory(self) -> None:
        peaks.reset(self.device)  # a fresh peak: a sweep runs experiments one after another in one process

    def peak_memory_mb(self) -> float:
        return peaks.peak_mb(self.device)  # peak CUDA allocation, or the process's peak RSS on CPU

    def close(self) -> None:
        if self.is_distributed and dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def session(cfg: TrainConfig) -> Iterator[Strategy]:
    strategy = Strategy.from_config(cfg)
    try:
        yield strategy
    finally:
        strategy.close()
