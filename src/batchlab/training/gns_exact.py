"""The exact gradient noise scale at given weights: every train row's own gradient, the truth
that the in-training estimates (gns.py) are checked against, by the tests, the benchmarks, the
study (its `b_simple_exact_at_target`) and `batchlab noise-scale` on a trained model.

Dropout's noise belongs to the gradient noise: a training step draws a mask per row, so the
gradient a step takes scatters over rows *and* masks. Σ here is that whole covariance, the
rows' part (Σ_rows, the covariance over rows of each row's mean gradient over masks) plus the
masks' part (Σ_mask, each row's covariance over masks, averaged over rows), and G is the mean
over both. A batch of B rows drawn without replacement from N, each row with its own mask, has

    E|g_B|² = |G|² + tr(Σ_rows)·(N-B)/(B(N-1)) + tr(Σ_mask)/B

(only the rows' part shrinks with the finite population). With `draws` masks per row: |G|² is the
mean over pairs of draws d≠e of G_d·G_e (G_d: the mean over rows of draw d's gradients), unbiased
because two draws' masks are independent; tr(Σ) = mean over rows and draws of |g|², minus |G|²;
tr(Σ_mask) = the mean over rows of the variance over draws. A model without stochastic layers
(or in eval mode) needs one draw, and all three are exact.

Cost: vmap(grad) over `chunk` rows at a time, ~12 µs a row and draw for the params.yaml MLP on
one thread (2800 rows, 8 draws: ~0.4 s); memory: chunk × draws × parameters floats. A model of
Linear layers on rows (the MLP: `row_wise_linears`) takes no row's gradient apart: a row's
gradient of a Linear's weight is δ·aᵀ (a: the layer's input, δ: the gradient of the row's loss at
its output), so the sums, |g|² = |δ|²(|a|² + 1) and, across draws, g_d·g_e = (δ_d·δ_e)(a_d·a_e + 1)
come from one batched forward and backward per draw (`_factored`), the same figures at a
fraction of the cost; each row still gets its own mask per draw, drawn by the batched forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

if TYPE_CHECKING:
    from batchlab.data import Split

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
DRAWS = 8  # dropout masks per row: the |G|² estimate's relative error from the masks is ~1/sqrt(draws pairs)


@dataclass(frozen=True)
class ExactNoise:
    """The noise scale of `rows` rows at one set of weights (all figures in the loss's units)."""

    rows: int
    draws: int
    grad_sq: float  # |G|²
    trace: float  # tr(Σ): rows and dropout masks
    trace_mask: float  # tr(Σ_mask): dropout's part of it (0 without stochastic layers)

    @property
    def b_simple(self) -> float:
        return self.trace / self.grad_sq if self.grad_sq > 0 else float("nan")

    def batch_grad_sq(self, batch: int) -> float:
        """E|g_B|²: the expected squared norm of a step's mean gradient over `batch` rows drawn
        without replacement (module docstring)."""
        rows_part = (self.trace - self.trace_mask) * (self.rows - batch) / (batch * max(self.rows - 1, 1))
        return self.grad_sq + rows_part + self.trace_mask / batch


def batch_coupled(model: nn.Module) -> str | None:
    """Why a row's gradient depends on the other rows of its batch (batch statistics: BatchNorm), so
    that no noise scale of per-row gradients exists to measure; None when it does not."""
    norms = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)})
    if norms:
        return f"for a model with {', '.join(norms)} (a row's gradient depends on its batch's statistics)"
    return None


def is_stochastic(model: nn.Module) -> bool:
    """Whether a training-mode forward draws random masks (a dropout layer with p > 0)."""
    return model.training and any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


# the layers a row-wise model (row_wise_linears) is made of: each maps a row to a row
ROW_WISE = (nn.Linear, nn.Identity, nn.Dropout, nn.ReLU, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.ELU)

# a Linear's part of a batched pass: (the layer, its input a [rows, in], its output [rows, out])
Tap = tuple[nn.Linear, torch.Tensor, torch.Tensor]


def row_wise_linears(model: nn.Module, x: torch.Tensor) -> list[nn.Linear] | None:
    """The Linear layers of `model` when it is an nn.Sequential of ROW_WISE layers, none in place,
    on rows [rows, features]: nothing mixes rows, so a row's gradient of each Linear factors into
    its input and the gradient at its output. None for any other model. A Linear the forward
    applies twice does not factor: it shows as more taps (`tapped`) than Linears, which callers check."""
    layers = [m for m in model.modules() if not isinstance(m, nn.Sequential)]
    if not isinstance(model, nn.Sequential) or x.dim() != 2:
        return None
    if not all(isinstance(m, ROW_WISE) and not getattr(m, "inplace", False) for m in layers):
        return None
    return [m for m in layers if isinstance(m, nn.Linear)]


@contextmanager
def tapped(linears: list[nn.Linear]) -> Iterator[list[Tap]]:
    """Each Linear's input and output in the forwards run inside, in call order."""
    taps: list[Tap] = []

    def keep(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        taps.append((module, inputs[0], output))  # type: ignore[arg-type]

    hooks = [m.register_forward_hook(keep) for m in linears]
    try:
        yield taps
    finally:
        for hook in hooks:
            hook.remove()


# a Linear's part of each row's |g_row|²: |δ|² and |a|² per row, and whether its bias trains
RowTerms = tuple[torch.Tensor, torch.Tensor, bool]


def row_square_sums(start: torch.Tensor, terms: list[RowTerms]) -> torch.Tensor:
    """[Σ |g_row|², Σ |g_row|⁴] over the rows (the last dimension) of a row-wise model, from each
    trained Linear's terms, first to last: |g_row|² = Σ |δ|²·|a|² (+ |δ|² with a bias), added to
    `start` (zeros shaped like a term). One order of sums for the probe and the seed group's stacked
    probe, whose readings must be the same bits."""
    per = start
    for d2, a2, bias in terms:
        per = per + d2 * a2
        if bias:
            per = per + d2
    return torch.stack([per.sum(-1), per.square().sum(-1)], dim=-1)


def exact_noise_scale(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, draws: int = DRAWS, seed: int = 0,
    chunk: int = 512,
) -> ExactNoise:
    """|G|², tr(Σ) and tr(Σ_mask) over the rows (x, y) at the model's weights, in its mode (train
    mode: dropout on, as a training step has it). Leaves the weights and the global RNG as they were;
    `seed` seeds the masks, so the figures are reproducible."""
    if x.shape[0] < 2:
        raise ValueError(f"the exact noise scale needs at least 2 rows, got {x.shape[0]}")
    draws = draws if is_stochastic(model) else 1
    devices = [x.device] if x.device.type == "cuda" else []
    linears = row_wise_linears(model, x)
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        found = _factored(model, linears, loss_fn, x, y, draws, chunk) if linears is not None else None
        if found is not None:
            return found
        torch.manual_seed(seed)
        return _vmapped(model, loss_fn, x, y, draws, chunk)


def exact_at_weights(model: nn.Module, rows: Split, draws: int = DRAWS) -> ExactNoise | None:
    """The exact noise scale of the cross-entropy over `rows` (a split: every row's gradient) at the
    model's weights as they are, in train mode (dropout's masks drawn as a step draws them): what the
    sweep's truth, the local CBS's points and `batchlab noise-scale` compute. None where a row's
    gradient depends on its batch (batch_coupled: no per-row gradient to compare with)."""
    if batch_coupled(model) is not None:
        return None
    x, y = torch.from_numpy(rows.x), torch.from_numpy(rows.y)
    return exact_noise_scale(model.train(), torch.nn.functional.cross_entropy, x, y, draws=draws)


def _factored(
    model: nn.Module, linears: list[nn.Linear], loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, draws: int,
    chunk: int,
) -> ExactNoise | None:
    """exact_noise_scale for a row-wise model (row_wise_linears), from one batched forward and
    backward per draw and chunk (the module docstring's factored figures); None where a forward
    applies a Linear twice (its row's gradient does not factor)."""
    rows = x.shape[0]
    sums: list[torch.Tensor | None] = [None] * draws  # each draw's gradient summed over rows, float64
    squares = within = 0.0
    for start in range(0, rows, chunk):
        xs, ys = x[start : start + chunk], y[start : start + chunk]
        passes: list[list[tuple[torch.Tensor, torch.Tensor, bool, bool]]] = []  # per draw, per live Linear
        for draw in range(draws):
            with tapped(linears) as taps, torch.enable_grad():
                logits = model(xs)
                if len(taps) != len(linears):
                    return None
                loss = loss_fn(logits, ys) * xs.shape[0]  # every row's own loss, summed
                live = [(m, a, out) for m, a, out in taps if out.requires_grad]
                deltas = torch.autograd.grad(loss, [out for _, _, out in live], allow_unused=True)
            layers, flat = [], []
            for (module, a, _), delta in zip(live, deltas, strict=True):
                if delta is None:
                    continue
                a, delta = a.detach(), delta.detach()
                weight, bias = module.weight.requires_grad, module.bias is not None and module.bias.requires_grad
                flat += [(delta.T @ a).flatten()] if weight else []
                flat += [delta.sum(0)] if bias else []
                layers.append((a, delta, weight, bias))
            summed = torch.cat(flat).double()
            sums[draw] = summed if sums[draw] is None else sums[draw] + summed  # type: ignore[operator]
            passes.append(layers)
        products = _draw_products(passes)  # [rows, draws, draws]: g_d · g_e per row
        chunk_squares = float(products.diagonal(dim1=1, dim2=2).sum())
        squares += chunk_squares
        if draws > 1:  # Σ_d |g_d - mean|² = Σ_d |g_d|² - |Σ_d g_d|² / D, per row, summed
            within += (chunk_squares - float(products.sum()) / draws) / (draws - 1)
    means = torch.stack([s for s in sums if s is not None]) / rows
    return _figures(means, squares, within, rows, draws)


def _draw_products(passes: list[list[tuple[torch.Tensor, torch.Tensor, bool, bool]]]) -> torch.Tensor:
    """Per row, every pair of draws' gradient dot product g_d · g_e, [rows, draws, draws] in
    float64: Σ over the Linears of (δ_d·δ_e)(a_d·a_e with the weight, + 1 with a bias)."""
    total: torch.Tensor | None = None
    for layer in zip(*passes, strict=True):  # one Linear, every draw
        a = torch.stack([draw[0] for draw in layer], 1)  # [rows, draws, inputs]
        delta = torch.stack([draw[1] for draw in layer], 1)  # [rows, draws, outputs]
        weight, bias = layer[0][2], layer[0][3]
        deltas = torch.bmm(delta, delta.transpose(1, 2)).double()  # [rows, draws, draws]
        inputs = torch.bmm(a, a.transpose(1, 2)).double() if weight else torch.zeros_like(deltas)
        part = deltas * (inputs + (1.0 if bias else 0.0))
        total = part if total is None else total + part
    assert total is not None
    return total


def _figures(means: torch.Tensor, squares: float, within: float, rows: int, draws: int) -> ExactNoise:
    """The figures from each draw's mean gradient [draws, parameters] (float64), the sum over rows
    and draws of |g|² and the rows' summed spread over draws."""
    if draws > 1:
        total = means.sum(0)
        grad_sq = float((total @ total - means.square().sum()) / (draws * (draws - 1)))
    else:
        grad_sq = float(means[0] @ means[0])
    trace = squares / (rows * draws) - grad_sq
    return ExactNoise(rows, draws, grad_sq, trace, within / rows)


def _vmapped(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, draws: int, chunk: int) -> ExactNoise:
    """exact_noise_scale for any model: every row's gradient through vmap(grad), `chunk` rows a call."""
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    buffers = dict(model.named_buffers())

    def one_loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return loss_fn(functional_call(model, (p, buffers), (xi.unsqueeze(0),)), yi.unsqueeze(0))

    per_example = vmap(grad(one_loss), in_dims=(None, 0, 0), randomness="different")
    rows = x.shape[0]
    sums = [{k: torch.zeros_like(p, dtype=torch.float64) for k, p in params.items()} for _ in range(draws)]
    squares = within = 0.0  # sum over rows and draws of |g|²; of each row's squared deviations over draws
    with torch.no_grad():
        for start in range(0, rows, chunk):
            xs, ys = x[start : start + chunk], y[start : start + chunk]
            row_sums: dict[str, torch.Tensor] = {}  # each row's gradient summed over draws
            chunk_squares = 0.0
            for draw in range(draws):
                for k, g in per_example(params, xs, ys).items():
                    sums[draw][k] += g.sum(0, dtype=torch.float64)
                    chunk_squares += float(_sq(g))
                    row_sums[k] = g if draw == 0 else row_sums[k] + g
            squares += chunk_squares
            if draws > 1:  # sum_d |g_d - mean|² = sum_d |g_d|² - D |mean|², per row, summed
                mean_squares = sum(float(_sq(v)) for v in row_sums.values()) / draws
                within += (chunk_squares - mean_squares) / (draws - 1)
    means = torch.stack([torch.cat([v.flatten() for v in draw.values()]) for draw in sums]) / rows
    return _figures(means, squares, within, rows, draws)


def _sq(t: torch.Tensor) -> torch.Tensor:
    """The sum of squares of a tensor's elements (one BLAS dot, no temporary)."""
    flat = t.reshape(-1)
    return torch.dot(flat, flat)
