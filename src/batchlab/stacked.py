"""The seeds' models as one (vectorized.py): stacked weights, a batched forward and backward.

`torch.func.stack_module_state` stacks the seeds' weights into [S, ...] tensors; each seed's
nn.Module stays, its parameters views of its slice, so its optimizer state, checkpoint and
per-example noise probe see the live weights. The forward is batched matrix products
(baddbmm), not vmap(functional_call): for the [64, 64] MLP at batch 16-64, 5 seeds, a forward
and backward took ~1.5x one seed's with baddbmm and ~3.4x through vmap (dispatch-bound sizes,
1 thread, measured side by side); both give F.linear's numbers per seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import stack_module_state

from batchlab.checkpoint import Checkpoint, Trainee, TrainState
from batchlab.config import Config
from batchlab.gns import NoiseScale, PerExampleProbe
from batchlab.strategy import Strategy
from batchlab.tracking import Tracker


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
    probe: PerExampleProbe | None = None
    active: bool = True  # False once early stopping stopped it: its weights and figures stay as they are

    @property
    def params(self) -> list[nn.Parameter]:
        return list(self.trainee.model.parameters())


class StackedModels:
    """The seeds' models as one: their weights in [S, ...] tensors, their gradients in one buffer."""

    def __init__(self, seeds: list[Seed], strategy: Strategy) -> None:
        self.seeds, self.strategy, self.rows = seeds, strategy, 0
        strategy.reset_peak_memory()
        self.weights, _ = stack_module_state([s.trainee.model for s in seeds])
        # the Sequential's layers, looked up once: (weight, bias) of a Linear, a Dropout's p, an activation
        self.plan: list[tuple[tuple[torch.Tensor, torch.Tensor] | None, float | None, nn.Module | None]] = []
        for index, layer in enumerate(seeds[0].trainee.model.children()):
            if isinstance(layer, nn.Linear):
                self.plan.append(((self.weights[f"{index}.weight"], self.weights[f"{index}.bias"]), None, None))
            else:
                self.plan.append((None, layer.p, None) if isinstance(layer, nn.Dropout) else (None, None, layer))
        # gradients as views of one buffer, as Strategy.setup does: zeroing is one op. A parameter's
        # block holds its [S, ...] gradient contiguously (the fused optimizers need that)
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
                seed.probe = PerExampleProbe(seed.trainee.model, F.cross_entropy, rng=seed.dropout)

    def forward(self, x: torch.Tensor, train: bool) -> torch.Tensor:
        """Logits [S, rows, classes] of inputs [S, rows, features]; in training each seed's dropout
        masks come from its generator exactly as F.dropout draws them (bernoulli_, then / (1 - p))."""
        h = x
        for linear, dropout, activation in self.plan:
            if linear is not None:
                h = _StackedLinear.apply(h, *linear)
            elif dropout is not None:
                if train and dropout > 0:
                    mask = torch.empty_like(h)
                    for seed in self.seeds:
                        mask[seed.index].bernoulli_(1 - dropout, generator=seed.dropout)
                    h = h * mask.div_(1 - dropout)
            elif activation is not None:  # elementwise
                h = activation(h)
        return h

    def backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each seed's mean loss over its rows, [S]; their sum's backward gives each seed its own gradient."""
        n, rows = targets.shape
        self.rows = rows
        log_probs = F.log_softmax(self.forward(inputs, train=True), dim=2)  # cross_entropy's own two steps
        per_row = F.nll_loss(log_probs.flatten(0, 1), targets.flatten(), reduction="none").view(n, rows)
        per_row.mean(1).sum().backward()
        for i, seed in enumerate(self.seeds):
            if seed.probe is not None and seed.active:
                seed.probe.after_backward(seed.noise.steps + 1, inputs[i], targets[i])
        # the figure a separate run records, bit for bit: nll_loss's mean sums in its own order
        with torch.no_grad():
            return torch.stack([F.nll_loss(log_probs[i], targets[i]) for i in range(n)])

    def measure(self) -> torch.Tensor:
        """Each seed's gradient norm, [S], given with the probe's measurement to its noise scale."""
        # a seed's gradient lies in every parameter's block: gathered into one row per seed, whose
        # norm is bit for bit the norm of a separate run's flat gradient buffer
        norms = torch.linalg.vector_norm(torch.cat(self.blocks, dim=1), dim=1)
        for i, seed in enumerate(self.seeds):
            if seed.probe is not None and seed.active:
                seed.noise.record_step(norms[i], seed.probe.small(seed.noise.steps + 1, 1.0), self.rows)
        return norms

    def stepping(self, norms: torch.Tensor) -> list[bool]:
        """The seeds that take this step: still training, with a finite gradient (`fit` skips the others)."""
        finite = torch.isfinite(norms).tolist()  # on the CPU reading a value costs no sync
        return [seed.active and ok for seed, ok in zip(self.seeds, finite, strict=True)]

    def zero_grad(self) -> None:
        self.flat_grads.zero_()

    @torch.no_grad()
    def predict(self, x: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
        """Every seed's logits [S, rows, classes] for the same rows, dropout off."""
        n = len(self.seeds)
        parts = [
            self.forward(x[i : i + chunk].unsqueeze(0).expand(n, -1, -1), train=False)
            for i in range(0, x.shape[0], chunk)
        ]
        return torch.cat(parts, dim=1)


class _StackedLinear(torch.autograd.Function):
    """h @ w.T + b per seed, its gradients computed as F.linear's are (addmm's backward takes the
    weight's as grad.T @ h, in the weight's layout; bmm's own takes h.T @ grad, then transposes,
    which rounds differently): a seed's gradients are bit for bit a separate run's."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h, w)
        return torch.baddbmm(b.unsqueeze(1), h, w.transpose(1, 2))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        h, w = ctx.saved_tensors
        grad_h = torch.bmm(grad, w) if ctx.needs_input_grad[0] else None
        return grad_h, torch.bmm(grad.transpose(1, 2), h), grad.sum(1)
