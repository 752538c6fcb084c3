"""What the two stacked forms of the seeds (stacked.py: the MLP's kernels; functional.py: any
module through torch.func) share: each seed's place in the group, its weights as a slice of the
stacked ones, its gradient as a slice of one buffer, its norm, noise probe and step.

`torch.func.stack_module_state` stacks the seeds' weights into [S, ...] tensors; each seed's
nn.Module stays, its parameters views of its slice, so its optimizer state, checkpoint and
noise probe see the live weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import stack_module_state

from batchlab.config import Config
from batchlab.tracking import Tracker
from batchlab.training.checkpoint import Checkpoint, Trainee, TrainState
from batchlab.training.gns import NoiseScale
from batchlab.training.gns_estimates import FullSplitMeasure
from batchlab.training.gns_probes import FullSplitProbe
from batchlab.training.strategy import Strategy


@dataclass
class Seed:
    """One seed of the group: what `fit` holds for a separate run."""

    cfg: Config
    index: int  # its place in the stacked tensors
    trainee: Trainee  # its optimizer and schedule are kept in step with the group's for its checkpoint
    state: TrainState
    checkpoint: Checkpoint
    tracker: Tracker
    noise: NoiseScale
    dropout: torch.Generator  # what `fit` seeds the global RNG with each epoch, for this seed alone
    probe: FullSplitProbe | None = None
    active: bool = True  # False once early stopping stopped it: its weights and figures stay as they are
    curve_weights: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # train.curve_weights

    @property
    def params(self) -> list[nn.Parameter]:
        return list(self.trainee.model.parameters())


class SeedGroup:
    """The seeds' weights in [S, ...] tensors, their gradients in one buffer; a subclass gives
    `backward` (each seed's gradient into `blocks`) and `predict`."""

    def __init__(self, seeds: list[Seed], strategy: Strategy, train_rows: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.seeds, self.strategy, self.rows = seeds, strategy, 0
        strategy.reset_peak_memory()
        self.weights, self.buffers = stack_module_state([s.trainee.model for s in seeds])
        # gradients as views of one buffer, as Strategy.setup does. A parameter's block holds its
        # [S, ...] gradient contiguously (the fused optimizers need that)
        self.flat_grads = torch.zeros(sum(w.numel() for w in self.weights.values()), device=strategy.device)
        self.blocks: list[torch.Tensor] = []  # [S, n] per parameter
        offset = 0
        for name, stacked in self.weights.items():
            block = self.flat_grads[offset : offset + stacked.numel()].view(len(seeds), -1)
            stacked.grad = block.view_as(stacked)
            self.blocks.append(block)
            for i, seed in enumerate(seeds):
                param = seed.trainee.model.get_parameter(name)
                param.data = stacked.detach()[i]  # the seed's module and optimizer see the stacked weights
                param.grad = block[i].view_as(param)
            offset += stacked.numel()
        for seed in seeds:
            if seed.noise.enabled:  # after the views: the probe reads the live weights
                every = seed.cfg.train.gns_every
                seed.probe = FullSplitProbe(seed.trainee.model, F.cross_entropy, *train_rows, every, rng=seed.dropout)

    def backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        """Each seed's gradient of its mean loss over its rows (inputs [S, rows, ...], targets
        [S, rows]) into `blocks`; returns those losses, one 0-d tensor per seed."""
        raise NotImplementedError

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Every seed's logits [S, rows, classes] for the same rows, dropout off."""
        raise NotImplementedError

    def after_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """The seeds' noise probes count the step's rows, as Strategy.backward has them do."""
        self.rows = targets.shape[1]
        for seed, x, y in zip(self.seeds, inputs.unbind(), targets.unbind(), strict=True):
            if seed.probe is not None and seed.active:
                seed.probe.after_backward(seed.noise.steps + 1, x, y)

    def measure(self) -> torch.Tensor:
        """Each seed's gradient norm, [S], given with the probe's measurement to its noise scale."""
        # a seed's gradient lies in every parameter's block: gathered into one row per seed, whose
        # norm is bit for bit the norm of a separate run's flat gradient buffer
        norms = torch.linalg.vector_norm(torch.cat(self.blocks, dim=1), dim=1)
        probing = [seed for seed in self.seeds if seed.probe is not None and seed.active]
        due = [seed for seed in probing if seed.probe is not None and seed.probe.due(seed.noise.steps + 1)]
        measured: dict[int, FullSplitMeasure] = {}
        if due:
            steps = {seed.noise.steps + 1 for seed in due}
            if len(due) == len(self.seeds) and len(steps) == 1:  # every seed at once
                measured = dict(zip([s.index for s in due], self.probe_together(due, steps.pop()), strict=True))
            else:
                measured = {seed.index: seed.probe.measure(seed.noise.steps + 1) for seed in due if seed.probe}
        for seed in probing:
            seed.noise.record_step(norms[seed.index], measured.get(seed.index), self.rows)
        return norms

    def probe_together(self, seeds: list[Seed], step: int) -> list[FullSplitMeasure]:
        """The noise probes of every seed of the group at `step`, each what its separate run's probe
        measures: here each seed's own probe in turn (a subclass may share their arithmetic)."""
        return [seed.probe.measure(step) for seed in seeds if seed.probe is not None]

    def flat_weights(self) -> torch.Tensor:
        """Every seed's weights as one row [S, P], in its module's parameter order (a copy)."""
        return torch.cat([w.detach().reshape(len(self.seeds), -1) for w in self.weights.values()], dim=1)

    def stepping(self, norms: torch.Tensor) -> list[bool]:
        """The seeds that take this step: still training, with a finite gradient (`fit` skips the others)."""
        finite = torch.isfinite(norms).tolist()  # on the CPU reading a value costs no sync
        return [seed.active and ok for seed, ok in zip(self.seeds, finite, strict=True)]
