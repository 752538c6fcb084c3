"""The seeds of any module without batch statistics as one (vectorized.py): their stacked weights
(group.py) through `torch.func.vmap` over `functional_call`, one autograd backward for all.

Each seed's dropout masks are drawn outside vmap from its own generator, in the order and shape its
separate run draws them, and handed in as vmapped inputs to a stand-in copy of the model
(standins.py); vmap itself may draw nothing (`randomness="error"`). The noise probe, the val
predictions and the checkpoint use each seed's own module, whose parameters are views of the
stacked weights, so they are the separate run's calls on the same weights.

What vmap batches is not always the separate run's kernel (a conv of S seeds is one grouped conv,
a linear layer a batched matmul), so a seed's numbers equal its separate run's within 1e-5 in
fp32 on the CPU (tests/test_vectorized_generic.py), not bit for bit as the MLP's hand-written
kernels do (stacked.py). `why_apart` says which models cannot train this way, before any seed
does: batch statistics (BatchNorm), frozen parameters, random draws other than nn.Dropout's and
nn.MultiheadAttention's, buffers the forward changes, a forward vmap cannot run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from batchlab.seeds.group import Seed, SeedGroup
from batchlab.seeds.standins import Draw, Masks, Unsupported, draw_masks, stand_in
from batchlab.training.gns_exact import batch_coupled
from batchlab.training.strategy import Strategy
from batchlab.training.train import predict_logits

Tensors = dict[str, torch.Tensor]


def _said(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def stacked_losses(
    base: nn.Module, masks: Masks, state: tuple[Tensors, Tensors], inputs: torch.Tensor, targets: torch.Tensor,
    drawn: list[torch.Tensor],
) -> torch.Tensor:
    """Each seed's mean cross-entropy [S] over its rows (inputs [S, rows, ...], targets [S, rows]),
    through `base` (a stand-in) with the stacked weights and buffers `state` and dropout masks `drawn`."""

    def logits(weights: Tensors, buffers: Tensors, x: torch.Tensor, mine: list[torch.Tensor]) -> torch.Tensor:
        with masks.feeding(mine):
            out: torch.Tensor = functional_call(base, (weights, buffers), (x,))
        return out

    weights, buffers = state
    out = vmap(logits, randomness="error")(weights, buffers, inputs, drawn)  # [S, rows, classes]
    # cross_entropy's mean per seed on the stacked logits, outside vmap: nll_loss under vmap took
    # ~2 ms a step here (5 seeds, batch 32), these three ops ~30 µs
    picked = F.log_softmax(out, dim=2).gather(2, targets.unsqueeze(2)).squeeze(2)
    return -picked.mean(dim=1)


def record_draws(base: nn.Module, masks: Masks, state: tuple[Tensors, Tensors], x: torch.Tensor) -> list[Draw]:
    """The dropout draws of one training-mode forward of `base` on `x` with one seed's weights and
    buffers `state`, in order; nothing is drawn (raises Unsupported for a layer it cannot feed)."""
    with torch.no_grad(), masks.record() as draws:
        functional_call(base, state, (x,))
    return draws


def why_apart(model: nn.Module, example: torch.Tensor) -> str | None:
    """Why seeds of `model` (in train mode) cannot train together through vmap, tried on `example`
    (a batch of train rows); None when they can. Leaves the model and the global RNG as they were."""
    coupled = batch_coupled(model)
    if coupled is not None:
        return f"batch statistics {coupled}: its running statistics change in train mode"
    if not all(p.requires_grad for p in model.parameters()):
        return "frozen parameters (requires_grad=False): the stacked optimizer steps every parameter"
    masks = Masks()
    base = stand_in(model, masks).train()
    state: tuple[Tensors, Tensors] = ({k: p for k, p in model.named_parameters()}, dict(model.named_buffers()))
    buffers = [b.clone() for b in state[1].values()]
    with torch.random.fork_rng(devices=[]):
        rng = torch.get_rng_state()
        try:
            draws = record_draws(base, masks, state, example)
        except Unsupported as err:
            return f"{err}: its masks cannot be drawn per seed"
        if not torch.equal(rng, torch.get_rng_state()):
            return ("its forward draws random numbers besides nn.Dropout and nn.MultiheadAttention's dropout "
                    "(F.dropout in forward, Dropout2d, AlphaDropout, noise): no seed could draw them as its "
                    "separate run does")
    if not all(torch.equal(a, b) for a, b in zip(buffers, state[1].values(), strict=True)):
        return "its forward changes its buffers in train mode"
    pair = stack_module_state([model, model])
    try:
        drawn = draw_masks(draws, [torch.Generator(), torch.Generator()], example.device)
        rows = example.unsqueeze(0).expand(2, *example.shape)
        targets = torch.zeros(rows.shape[:2], dtype=torch.long, device=example.device)
        stacked_losses(base, masks, pair, rows, targets, drawn).sum().backward()
    except Exception as err:  # whatever vmap or the module raised: the seeds train apart, saying it
        return f"torch.func.vmap cannot run its forward and backward ({_said(err)})"
    return None


class FunctionalSeeds(SeedGroup):
    """The seeds' models as one through vmap(functional_call) (module docstring)."""

    def __init__(self, seeds: list[Seed], strategy: Strategy, train_rows: tuple[torch.Tensor, torch.Tensor]) -> None:
        super().__init__(seeds, strategy, train_rows)
        self.masks = Masks()
        self.base = stand_in(seeds[0].trainee.model, self.masks).train()
        self.draws: dict[tuple[int, ...], list[Draw]] = {}  # per input shape: its forward's dropout draws

    def backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        shape = tuple(inputs.shape[1:])
        if shape not in self.draws:
            first = ({k: w[0] for k, w in self.weights.items()}, {k: b[0] for k, b in self.buffers.items()})
            self.draws[shape] = record_draws(self.base, self.masks, first, inputs[0])
        drawn = draw_masks(self.draws[shape], [seed.dropout for seed in self.seeds], inputs.device)
        losses = stacked_losses(self.base, self.masks, (self.weights, self.buffers), inputs, targets, drawn)
        self.flat_grads.zero_()
        losses.sum().backward()  # each seed's loss depends on its own weights only: its own gradient
        self.after_backward(inputs, targets)
        return list(losses.detach().unbind())

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Every seed's logits [S, rows, classes], each from its own module: the separate run's call."""
        logits = torch.stack([predict_logits(seed.trainee.model, x, self.strategy) for seed in self.seeds])
        for seed in self.seeds:
            seed.trainee.model.train()  # predict_logits left it in eval mode; the noise probe trains it
        return logits
