"""The probe that measures the noise scale at fixed weights (gns.py has the estimators): |G|² from
the train split's mean gradient, tr(Σ) from sampled rows' own gradients, on one process or split
over DDP's ranks. The strategy builds it (strategy.py)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call, grad, vmap

from batchlab.training.gns import MAX_HALF_WINDOW
from batchlab.training.gns_estimates import FullSplitMeasure, Reading, pooled
from batchlab.training.gns_exact import is_stochastic, row_square_sums, row_wise_linears, tapped

log = logging.getLogger(__name__)

# the rows the full-split probe passes over: the whole train split up to this many (beyond it, as
# many drawn afresh each time); per pass, FULL_SPLIT_CHUNK rows at a time (its memory)
FULL_SPLIT_ROWS = 4096
FULL_SPLIT_CHUNK = 1024
# each pass's gradient is summed in PARTS slices of the rows: the spread of the passes' difference
# over them gives the variance of the |G|² reading (a reading's standard error)
PARTS = 8
# its period, from a cost model fitted in bench_gns (MLP [64, 64], 1 thread): a step over B rows
# costs about (DISPATCH_ROWS + B) rows' worth (~0.39 ms fixed, ~1.9 µs a row), a pass over M rows
# about (DISPATCH_ROWS + M), so measuring every k-th step costs passes·(DISPATCH_ROWS + M) /
# (k·(DISPATCH_ROWS + B)) of the steps' time; k keeps that at FULL_SPLIT_OVERHEAD, half the 10%
# allowed: the bookkeeping adds ~1.5%, and side by side runs scatter by ±5% here; with the rows'
# own gradients (ROW_COST below; params.yaml's 2800 rows, 2 passes: batch 16 every 840th step, 64
# every 688th, 512 every 255th), never more often than every FULL_SPLIT_MIN_EVERY-th
FULL_SPLIT_OVERHEAD = 0.05
DISPATCH_ROWS = 200
FULL_SPLIT_MIN_EVERY = 5
# tr(Σ) from up to ROW_SAMPLE rows' own gradients at the probe's weights (torch.func, ROW_CHUNK
# rows at a time), one dropout mask each: E|g_row|² = |G|² + tr(Σ). The steps' own norms around the
# probe read 1.6-3x the exact value for the transformer on 1400 rows (median over 7 probes): a
# step's rows are the ones not yet trained on this epoch, whose gradients are larger than a
# random batch's once a model memorizes its rows. A row's gradient costs ~6 rows of a batched
# pass (gns_exact: ~12 µs against ~1.9 µs)
ROW_SAMPLE = 512
# the reading at the saved weights: this many measurements pooled (each |G|² late in training reads
# within ~±35% alone, 1 standard error), their rows drawn as a step past any training's would
SAVED_PROBES = 4
SAVED_STEP = 10**9
DRAW_STRIDE = 1_000_003  # another draw's rows: seeded as a far-off step's
# vmap takes the rows' own gradients ROW_CHUNK rows a call, fewer where a chunk's gradients (one
# per row) would pass ROW_FLOATS (64 MiB of fp32): 128 rows a call took 25% / 6% less time than 64
# for the CNN / transformer examples on 1 thread, and 512 took 72% more for the CNN (bench_gns)
ROW_CHUNK = 128
ROW_FLOATS = 16 * 2**20
ROW_COST = 6

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def full_split_every(rows: int, batch: int, passes: int) -> int:
    """The full-split probe's period in steps, from the cost model above."""
    probe = passes * (DISPATCH_ROWS + rows) + ROW_COST * min(rows, ROW_SAMPLE)
    cost = probe / (FULL_SPLIT_OVERHEAD * (DISPATCH_ROWS + batch))
    return max(FULL_SPLIT_MIN_EVERY, math.ceil(cost))


class FullSplitProbe:
    """|G|² at the current weights from the mean gradient over the train split (up to
    FULL_SPLIT_ROWS rows), taken twice with independent dropout masks: their dot product is
    unbiased for |G|² (the masks' noise cancels; over the whole split the rows' noise is gone), and
    half their squared difference measures the masks' noise. tr(Σ) comes from the same weights:
    the per-example gradients (torch.func) of ROW_SAMPLE train rows drawn for the step; where vmap
    cannot run the model's forward, from the steps' own gradient norms around it (gns.NoiseScale's
    window). Every `every`-th step (default `full_split_every` from the step's rows).

    Runs in fp32 outside autocast, leaves the weights' gradients (torch.autograd.grad), the
    buffers (a BatchNorm's running statistics) and the global RNG as it found them, so training
    takes the same steps with or without it. With `rng`
    (the generator the step's dropout drew from, when not the global one: vectorized seeds) its
    masks start from that generator's state, as a separate run's start from the global RNG's."""

    def __init__(
        self, model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, every: int | None = None,
        rng: torch.Generator | None = None, rank: int = 0, world_size: int = 1,
    ) -> None:
        self.model, self.loss_fn, self.x, self.y, self.every, self.rng = model, loss_fn, x, y, every, rng
        self.rank, self.world_size = rank, world_size  # DDP: each rank takes every world_size-th row
        self.params = [p for p in model.parameters() if p.requires_grad]  # the live ones
        self.passes = 2 if is_stochastic(model) else 1
        self.rows_per_pass = min(x.shape[0], FULL_SPLIT_ROWS)
        self.draw = torch.Generator(device=x.device)  # which rows, when the split is larger: seeded by step
        self.draw_rows = torch.Generator(device=x.device)  # the rows tr(Σ) is taken from: seeded by step and rank
        self.step_rows = 0
        self.rows_fail: str | None = None  # why the rows' own gradients cannot be taken (vmap refused the forward)
        # it measures at the steps k = first, first + every, ..., i.e. the weights after k - 1 steps
        # (None: first = every). A period given (a sweep's, train.gns_every) measures the weights
        # after each multiple of it: a val point's where eval_every_steps divides it, kept there, so
        # the exact value can be taken at the weights the reading measured (sweep/truth.py)
        self.first: int | None = every + 1 if every is not None else None

    def after_backward(self, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        if self.every is None:
            self.step_rows += inputs.shape[0]

    def small(self, step: int) -> FullSplitMeasure | None:
        return self.measure(step) if self.due(step) else None

    def due(self, step: int) -> bool:
        """Whether the probe measures at `step` (a group of seeds may measure theirs together)."""
        if self.every is None:  # from the first step's (global) rows: the same period every run and rank
            self.every = full_split_every(self.rows_per_pass, self.step_rows * self.world_size, self.passes)
        start = self.every if self.first is None else self.first
        return step >= start and (step - start) % self.every == 0

    def split_rows(self, step: int, draw: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The train rows a measurement at `step` passes over (all of the split, or FULL_SPLIT_ROWS
        of it drawn by step: the same rows on every rank and every seed of a group)."""
        x, y = self.x, self.y
        if x.shape[0] > self.rows_per_pass:  # one generator, one seed by step, as the rows' own
            # gradients are: a resumed run draws what an unbroken one drew
            self.draw.manual_seed(step + DRAW_STRIDE * draw)
            pick = torch.randperm(x.shape[0], generator=self.draw, device=x.device)[: self.rows_per_pass]
            x, y = x[pick], y[pick]
        return x, y

    def row_pick(self, step: int, rows: int) -> torch.Tensor:
        """Which of this rank's `rows` rows the rows' own gradients are taken from at `step`."""
        share = min(rows, math.ceil(ROW_SAMPLE / self.world_size))
        self.draw_rows.manual_seed(step * 1009 + self.rank)  # a resumed run draws the same rows
        return torch.randperm(rows, generator=self.draw_rows, device=self.x.device)[:share]

    def measure(self, step: int, draw: int = 0) -> FullSplitMeasure:
        """A measurement at the current weights now, its rows drawn by `step` (and rank). `draw` > 0:
        another measurement at the same weights and step, with masks and rows of its own (draw 0's
        masks are the training's RNG state's, as a scheduled probe's)."""
        x, y = self.split_rows(step, draw)
        rows = x.shape[0]
        x, y = x[self.rank :: self.world_size], y[self.rank :: self.world_size]
        devices = [x.device] if x.device.type == "cuda" else []  # the CPU generator is always restored
        buffers = [b.clone() for b in self.model.buffers()]
        with torch.random.fork_rng(devices=devices):
            if self.rng is not None:  # dropout draws from the global RNG: give it this seed's state
                torch.set_rng_state(self.rng.get_state())
            if draw:  # masks of its own, still a function of the run's state: reproducible
                torch.manual_seed(int(torch.randint(2**62, (1,)).item()) + draw)
            parts = min(PARTS, x.shape[0])  # every rank the same count: DDP sums part by part
            sums = torch.stack([self._summed_gradient(x, y, parts) for _ in range(self.passes)])
            squares = self._row_squares(step + DRAW_STRIDE * draw, x, y)
        with torch.no_grad():
            for saved, live in zip(buffers, self.model.buffers(), strict=True):
                live.copy_(saved)
        if self.world_size > 1:  # every rank's share of the rows: two collectives every `every` steps
            dist.all_reduce(sums)
            if squares is not None:  # the same model on every rank: all take it, or none
                dist.all_reduce(squares)
        return self.assemble(sums, squares, rows)

    def assemble(self, sums: torch.Tensor, squares: torch.Tensor | None, rows: int) -> FullSplitMeasure:
        """The measurement from its sums: the passes' gradients summed over each slice of the `rows`
        rows ([passes, parts, parameters]) and [Σ |g_row|², rows drawn, Σ |g_row|⁴] (None: tr(Σ)
        from the steps' norms), summed over the ranks."""
        first, second = sums[0].sum(0) / rows, sums[-1].sum(0) / rows
        half_diff_sq = (first - second).square().sum() / 2 if self.passes > 1 else torch.zeros((), device=sums.device)
        cross_var = _cross_variance((sums[0] - sums[-1]) / rows, (first + second) / 2)
        half_window = max(1, min((self.every or 2) // 2, MAX_HALF_WINDOW))
        if squares is None:  # tr(Σ) from the steps' norms
            return FullSplitMeasure(torch.dot(first, second), half_diff_sq, rows, half_window, cross_var=cross_var)
        count, row_sq = squares[1], squares[0] / squares[1]
        # the variance of that mean: over the rows drawn without replacement from the `rows` probed
        # (the finite-population factor), and over each row's one mask, which no factor shrinks: with
        # masks, the spread over rows is taken whole (it holds both: the interval errs wide)
        spread = (squares[2] / count - row_sq.square()) * count / (count - 1).clamp(min=1)
        finite = (1 - count / rows) * rows / max(rows - 1, 1) if self.passes == 1 else 1.0
        row_sq_var = spread / count * finite
        return FullSplitMeasure(torch.dot(first, second), half_diff_sq, rows, half_window, row_sq, row_sq_var,
                                cross_var)

    def _row_squares(self, step: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """[sum of sampled rows' |g_row|², their count, sum of |g_row|⁴] on this rank, or None for a model whose forward
        torch.func cannot run one row at a time (`.item()`, data-dependent control flow): told once,
        its tr(Σ) then comes from the steps' own gradient norms around the probe, as before."""
        if self.rows_fail is not None:
            return None
        pick = self.row_pick(step, x.shape[0])
        share = pick.shape[0]
        try:
            total = row_squares(self.model, self.loss_fn, x[pick], y[pick])
        except Exception as err:  # the user's forward: any error vmap or it raises
            self.rows_fail = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
            log.warning("noise scale: the rows' own gradients need a forward torch.func.vmap can run (%s); "
                        "tr(Σ) comes from the steps' gradient norms instead", self.rows_fail)
            return None
        return torch.stack([total[0], torch.tensor(float(share), device=x.device), total[1]])

    def _summed_gradient(self, x: torch.Tensor, y: torch.Tensor, parts: int) -> torch.Tensor:
        """The loss's gradient summed over each of `parts` slices of the rows: [parts, parameters]
        (their sum is the split's; apart, their masks' noise is `_cross_variance`'s)."""
        sums = []
        for xp, yp in zip(x.tensor_split(parts), y.tensor_split(parts), strict=True):
            total: torch.Tensor | None = None
            for start in range(0, xp.shape[0], FULL_SPLIT_CHUNK):
                xs, ys = xp[start : start + FULL_SPLIT_CHUNK], yp[start : start + FULL_SPLIT_CHUNK]
                with torch.enable_grad():  # the loss summed over the chunk's rows
                    loss = self.loss_fn(self.model(xs).float(), ys) * xs.shape[0]
                    grads = torch.autograd.grad(loss, self.params)
                flat = torch.cat([g.reshape(-1) for g in grads]).float()
                total = flat if total is None else total + flat
            assert total is not None
            sums.append(total)
        return torch.stack(sums)


def at_saved_weights(probe: FullSplitProbe, population: int | None, probes: int = SAVED_PROBES) -> Reading | None:
    """The noise scale at the weights training keeps (the best epoch's, models/model.pt), pooled
    over `probes` measurements there: the figure `batchlab noise-scale` holds to the exact value at
    the same weights. None where the rows' own gradients cannot be taken (no standard error, and
    the steps' norms around a probe belong to other weights). Every DDP rank calls it (the probe
    all-reduces)."""
    return reading_now(probe, population, probes, SAVED_STEP)


def reading_now(probe: FullSplitProbe, population: int | None, probes: int = 1, step: int = 0) -> Reading | None:
    """A reading of the current weights, pooled over `probes` measurements at `step` (each draw its
    own masks and rows); None where the rows' own gradients cannot be taken."""
    measures = [probe.measure(step, draw) for draw in range(probes)]
    if any(m.row_sq is None for m in measures):
        return None
    return pooled(measures, population)


def _cross_variance(diffs: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """The variance of ḡ¹·ḡ² from the masks, 2·GᵀCG + tr(C²) (C: the covariance of a pass's mean
    gradient over its masks), from the two passes' difference in each slice of rows (`diffs`,
    [parts, parameters]: d_k, independent across slices, Σ_k Cov(d_k) = 2C) and their mean ḡ ≈ G:
    GᵀCG = E Σ_k (d_k·G)² / 2 and tr(C²) = E Σ_{j≠k} (d_j·d_k)² / (4 (1 - 1/K)) with equal slices.
    0 with one pass (no dropout: no masks' noise)."""
    parts = diffs.shape[0]
    if parts < 2 or not bool(diffs.any()):
        return torch.zeros((), device=diffs.device)
    along = (diffs @ mean).square().sum() / 2
    gram = (diffs @ diffs.T).square()
    trace_cc = (gram.sum() - gram.diagonal().sum()) / (4 * (1 - 1 / parts))
    return 2 * along + trace_cc


def row_chunk(parameters: int) -> int:
    """How many rows' own gradients one call takes for a model of `parameters` (ROW_FLOATS)."""
    return max(1, min(ROW_CHUNK, ROW_FLOATS // max(parameters, 1)))


def row_squares(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[Σ |g_row|², Σ |g_row|⁴] over the rows (x, y), each row's own gradient at the model's weights,
    one dropout mask a row, in fp32: the mean squared norm and its spread over rows (a reading's
    standard error). A model of Linear layers on rows (the MLP) gets them from one forward and
    backward (linear_row_squares); any other through vmap over grad, row_chunk rows at a time."""
    found = linear_row_squares(model, loss_fn, x, y)
    return found if found is not None else _vmapped_row_squares(model, loss_fn, x, y)


def linear_row_squares(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
    """row_squares from one batched forward and backward for a row-wise model (the MLP:
    gns_exact.row_wise_linears): |g_row|² = Σ |δ|²·(|a|² + 1 with a bias) per Linear, exactly, at
    a batched pass's cost. None for any other model (vmap takes it)."""
    linears = row_wise_linears(model, x)
    if linears is None:
        return None
    with tapped(linears) as taps, torch.enable_grad():
        logits = model(x)
        if len(taps) != len(linears):
            return None  # a Linear applied twice: a row's gradient of it does not factor
        loss = loss_fn(logits.float(), y) * x.shape[0]  # every row's own loss, summed
        live = [(module, a, out) for module, a, out in taps if out.requires_grad]  # a frozen first layer's is not
        deltas = torch.autograd.grad(loss, [out for _, _, out in live], allow_unused=True)
    terms = [
        (delta.detach().float().square().sum(1), a.detach().float().square().sum(1),
         module.bias is not None and module.bias.requires_grad)
        for (module, a, _), delta in zip(live, deltas, strict=True)
        if delta is not None and module.weight.requires_grad
    ]
    return row_square_sums(torch.zeros(x.shape[0], device=x.device), terms)


def _vmapped_row_squares(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    buffers = dict(model.named_buffers())

    def one_loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return loss_fn(functional_call(model, (p, buffers), (xi.unsqueeze(0),)).float(), yi.unsqueeze(0))

    per_row = vmap(grad(one_loss), in_dims=(None, 0, 0), randomness="different")
    total = torch.zeros(2, device=x.device)
    chunk = row_chunk(sum(p.numel() for p in params.values()))
    for start in range(0, x.shape[0], chunk):
        grads = per_row(params, x[start : start + chunk], y[start : start + chunk])
        per = torch.stack([g.float().square().flatten(1).sum(1) for g in grads.values()]).sum(0)  # |g_row|²
        total = total + torch.stack([per.sum(), per.square().sum()])
    return total
