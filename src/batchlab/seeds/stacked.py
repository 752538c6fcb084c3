"""The seeds' MLPs as one (vectorized.py): a batched forward and a hand-written backward over
the stacked weights (group.py).

The forward is batched matrix products (baddbmm), not vmap(functional_call) (functional.py,
for any other module): for the [64, 64] MLP at batch 16-64, 5 seeds, a forward and backward took
~1.5x one seed's with baddbmm and ~3.4x through vmap (dispatch-bound sizes, 1 thread, measured
side by side); both give F.linear's numbers per seed.

The backward is written out, not taken by autograd: the MLP's graph is known, and each layer's
gradient is the kernel autograd calls for a separate run's layer (addmm's, the activation's,
dropout's mul, log_softmax's and nll_loss's backward), so a seed's gradients stay bit for bit
a separate run's. Without the autograd engine and its custom Functions a step of 5 seeds took
~300 µs less at batch 16-64 (~0.45 vs 0.70 ms at batch 16, measured side by side).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from batchlab.seeds.group import Seed, SeedGroup
from batchlab.training import gns_probes
from batchlab.training.gns_estimates import FullSplitMeasure
from batchlab.training.gns_exact import RowTerms, row_square_sums
from batchlab.training.strategy import Strategy

__all__ = ["ACTIVATION_BACKWARD", "Seed", "StackedModels"]


# What `backward` keeps of a layer: ("linear", input, weight, bias), ("dropout", mask) or
# ("activation", module, input, output)
_Saved = tuple[Any, ...]

# each activation's backward as autograd computes it for nn.ReLU, nn.GELU, nn.Tanh and nn.SiLU
# (derivatives.yaml), from the module, the gradient of its output, its input and its output
ACTIVATION_BACKWARD: dict[type[nn.Module], Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    nn.ReLU: lambda module, grad, x, out: torch.ops.aten.threshold_backward(grad, out, 0),
    nn.GELU: lambda module, grad, x, out: torch.ops.aten.gelu_backward(grad, x, approximate=module.approximate),
    nn.Tanh: lambda module, grad, x, out: torch.ops.aten.tanh_backward(grad, out),
    nn.SiLU: lambda module, grad, x, out: torch.ops.aten.silu_backward(grad, x),
}


class StackedModels(SeedGroup):
    """The seeds' MLPs as one: a Sequential of Linear, dropout and activation layers."""

    def __init__(self, seeds: list[Seed], strategy: Strategy, train_rows: tuple[torch.Tensor, torch.Tensor]) -> None:
        super().__init__(seeds, strategy, train_rows)
        # the Sequential's layers, looked up once: a Linear's (weight, bias) with their views as baddbmm
        # takes them (the optimizer steps the weights in place), a Dropout's p, an activation
        self.plan: list[tuple[tuple[torch.Tensor, ...] | None, float | None, nn.Module | None]] = []
        for index, layer in enumerate(seeds[0].trainee.model.children()):
            if isinstance(layer, nn.Linear):
                weight, bias = self.weights[f"{index}.weight"], self.weights[f"{index}.bias"]
                self.plan.append(((weight, bias, weight.transpose(1, 2), bias.unsqueeze(1)), None, None))
            elif isinstance(layer, nn.Dropout):
                self.plan.append((None, layer.p, None))
            elif type(layer) in ACTIVATION_BACKWARD:
                self.plan.append((None, None, layer))
            else:
                raise ValueError(f"seeds cannot train together through a {type(layer).__name__} layer")
        # per dropout layer and shape: the masks' buffer and each seed's part of it, drawn into each step
        self.masks: dict[tuple[int, torch.Size], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self.loss_grad: dict[int, float] = {}  # per row count: -1/rows as autograd's float32 mean backward has it

    def forward(
        self, x: torch.Tensor, train: bool, tape: list[_Saved] | None = None,
        generators: list[torch.Generator] | None = None,
    ) -> torch.Tensor:
        """Logits [S, rows, classes] of inputs [S, rows, features]; in training each seed's dropout
        masks come from its generator (`generators`, default the seeds' own) exactly as F.dropout
        draws them (bernoulli_, then / (1 - p)). With `tape`, what `backward` needs of each layer is
        appended to it."""
        generators = generators or [seed.dropout for seed in self.seeds]
        h = x
        for position, (linear, dropout, activation) in enumerate(self.plan):
            if linear is not None:
                weight, bias, weight_t, bias_row = linear
                if tape is not None:
                    tape.append(("linear", h, weight, bias))
                h = torch.baddbmm(bias_row, h, weight_t)
            elif dropout is not None:
                if train and dropout > 0:
                    mask, parts = self._mask_buffer(position, h)
                    for generator, part in zip(generators, parts, strict=True):
                        part.bernoulli_(1 - dropout, generator=generator)
                    mask.div_(1 - dropout)
                    if tape is not None:
                        tape.append(("dropout", mask))
                    h = h * mask
            elif activation is not None:  # elementwise
                out = activation.forward(h)  # no hooks to run: skips Module.__call__
                if tape is not None:
                    tape.append(("activation", activation, h, out))
                h = out
        return h

    def _mask_buffer(self, position: int, h: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The buffer of a dropout layer's masks, reused each step (a step's backward is done before
        the next forward), with each seed's part of it."""
        key = (position, h.shape)
        if key not in self.masks:
            mask = torch.empty_like(h)
            self.masks[key] = mask, list(mask.unbind())
        return self.masks[key]

    @torch.no_grad()
    def backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        """Each seed's gradient of its mean loss over its rows, written into the stacked weights'
        gradients; returns those losses, one 0-d tensor per seed."""
        rows = targets.shape[1]
        if rows not in self.loss_grad:
            self.loss_grad[rows] = -(torch.ones(()) / rows).item()

        def into_grads(h: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
            assert weight.grad is not None and bias.grad is not None  # F.linear's backward, in the weight's layout
            torch.bmm(grad.transpose(1, 2), h, out=weight.grad)
            torch.sum(grad, 1, out=bias.grad)

        # d(mean loss)/d(log_probs): -1/rows at each row's target, 1/rows divided in float32 as autograd's
        # mean backward divides it
        log_probs = self._backprop(inputs, targets, self.loss_grad[rows], into_grads)
        self.after_backward(inputs, targets)
        # the figure a separate run records, bit for bit: nll_loss's mean sums in its own order
        return [F.nll_loss(lp, y) for lp, y in zip(log_probs.unbind(), targets.unbind(), strict=True)]

    def _backprop(
        self, inputs: torch.Tensor, targets: torch.Tensor, at_target: float,
        linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None],
        generators: list[torch.Generator] | None = None,
    ) -> torch.Tensor:
        """A training forward of every seed and its backward from d(loss)/d(log_probs) = `at_target`
        at each row's target, as autograd computes cross_entropy's; `linear(h, grad, weight, bias)`
        takes each Linear's input and the gradient at its output, last layer first. Returns the log
        probabilities [S, rows, classes]."""
        tape: list[_Saved] = []
        log_probs = F.log_softmax(self.forward(inputs, True, tape, generators), dim=2)  # cross_entropy's two steps
        grad = torch.zeros_like(log_probs).scatter_(2, targets.unsqueeze(2), at_target)
        grad = torch.ops.aten._log_softmax_backward_data(grad, log_probs, 2, log_probs.dtype)  # as autograd calls it
        for saved in reversed(tape):
            if saved[0] == "linear":
                _, h, weight, bias = saved
                linear(h, grad, weight, bias)
                if saved is not tape[0]:  # the inputs need no gradient
                    grad = torch.bmm(grad, weight)
            elif saved[0] == "dropout":  # mul's backward
                grad = grad * saved[1]
            else:
                _, activation, h, out = saved
                grad = ACTIVATION_BACKWARD[type(activation)](activation, grad, h, out)
        return log_probs

    @torch.no_grad()
    def probe_together(self, seeds: list[Seed], step: int) -> list[FullSplitMeasure]:
        """The noise probes of `seeds` (all of the group, due at `step`) in one stacked pass each:
        the separate probe's arithmetic (FullSplitProbe.measure: the passes' gradients summed over
        each slice of the rows, the sampled rows' own |g_row|² as linear_row_squares takes them),
        its rows, and each seed's masks drawn from a copy of its generator in the order the
        separate probe draws them from the global RNG, so each seed's reading is its separate
        run's. The training's gradients, generators and weights are left as they were."""
        probe = seeds[0].probe
        assert probe is not None and len(seeds) == len(self.seeds) and probe.world_size == 1
        x, y = probe.split_rows(step)
        rows, n = x.shape[0], len(seeds)
        generators = []
        for seed in seeds:  # the state the separate probe copies into the global RNG
            generator = torch.Generator(device=x.device)
            generator.set_state(seed.dropout.get_state())
            generators.append(generator)
        parts = min(gns_probes.PARTS, rows)
        summed: list[torch.Tensor] = []  # per pass and slice: [S, parameters]
        for _ in range(probe.passes):
            for xp, yp in zip(x.tensor_split(parts), y.tensor_split(parts), strict=True):
                total: torch.Tensor | None = None
                chunk = gns_probes.FULL_SPLIT_CHUNK
                for start in range(0, xp.shape[0], chunk):
                    xs, ys = xp[start : start + chunk], yp[start : start + chunk]
                    grads: list[torch.Tensor] = []  # the layers' gradients, last layer first
                    # d(rows · mean loss)/d(log_probs): -1 at each row's target (rows/rows, exactly)
                    self._backprop(*self._stacked(xs, ys, n), -1.0, _gradients_into(grads), generators)
                    flat = torch.cat(grads, dim=1)
                    total = flat if total is None else total + flat
                assert total is not None
                summed.append(total)
        sums = torch.stack(summed, dim=1).view(n, probe.passes, parts, -1)
        pick = probe.row_pick(step, rows)
        squares = self._row_squares(x[pick], y[pick], generators)
        share = torch.tensor(float(pick.shape[0]), device=x.device)
        return [
            seed_probe.assemble(sums[i].clone(), torch.stack([squares[i, 0], share, squares[i, 1]]), rows)
            for i, seed_probe in enumerate(seed.probe for seed in seeds if seed.probe is not None)
        ]

    def _row_squares(self, x: torch.Tensor, y: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        """[S, 2]: each seed's [Σ |g_row|², Σ |g_row|⁴] over the rows, summed as the separate probe's
        linear_row_squares sums them (gns_exact.row_square_sums)."""
        terms: list[RowTerms] = []  # per Linear, last first: |δ|², |a|² per row

        def keep(h: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
            terms.insert(0, (grad.square().sum(2), h.square().sum(2), True))  # every built-in Linear has a bias

        self._backprop(*self._stacked(x, y, len(self.seeds)), -1.0, keep, generators)
        return row_square_sums(torch.zeros(len(self.seeds), x.shape[0], device=x.device), terms)

    @staticmethod
    def _stacked(x: torch.Tensor, y: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return x.unsqueeze(0).expand(n, *x.shape), y.unsqueeze(0).expand(n, *y.shape)

    @torch.no_grad()
    def predict(self, x: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
        """Every seed's logits [S, rows, classes] for the same rows, dropout off."""
        n = len(self.seeds)
        parts = [
            self.forward(x[i : i + chunk].unsqueeze(0).expand(n, -1, -1), train=False)
            for i in range(0, x.shape[0], chunk)
        ]
        return torch.cat(parts, dim=1)


def _gradients_into(
    grads: list[torch.Tensor],
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """What `_backprop` calls at each Linear to put its [S, parameters] weight and bias gradients
    (F.linear's backward: grad.T @ h, grad summed over rows) in front of `grads`, so they end in
    the model's parameter order."""

    def keep(h: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
        grads[:0] = [torch.bmm(grad.transpose(1, 2), h).flatten(1), grad.sum(1)]

    return keep
