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
one thread (2800 rows, 8 draws: ~0.3 s); memory: chunk × draws × parameters floats.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

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


def exact_noise_scale(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, draws: int = DRAWS, seed: int = 0,
    chunk: int = 512,
) -> ExactNoise:  # fmt: skip
    """|G|², tr(Σ) and tr(Σ_mask) over the rows (x, y) at the model's weights, in its mode (train
    mode: dropout on, as a training step has it). Leaves the weights and the global RNG as they were;
    `seed` seeds the masks, so the figures are reproducible."""
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    buffers = dict(model.named_buffers())

    def one_loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return loss_fn(functional_call(model, (p, buffers), (xi.unsqueeze(0),)), yi.unsqueeze(0))

    per_example = vmap(grad(one_loss), in_dims=(None, 0, 0), randomness="different")
    draws = draws if is_stochastic(model) else 1
    rows = x.shape[0]
    if rows < 2:
        raise ValueError(f"the exact noise scale needs at least 2 rows, got {rows}")
    sums = [{k: torch.zeros_like(p, dtype=torch.float64) for k, p in params.items()} for _ in range(draws)]
    squares = within = 0.0  # sum over rows and draws of |g|²; of each row's squared deviations over draws
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(seed)
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
    if draws > 1:
        total = means.sum(0)
        grad_sq = float((total @ total - means.square().sum()) / (draws * (draws - 1)))
    else:
        grad_sq = float(means[0] @ means[0])
    trace = squares / (rows * draws) - grad_sq
    return ExactNoise(rows, draws, grad_sq, trace, within / rows)


def _sq(t: torch.Tensor) -> torch.Tensor:
    """The sum of squares of a tensor's elements (one BLAS dot, no temporary)."""
    flat = t.reshape(-1)
    return torch.dot(flat, flat)
