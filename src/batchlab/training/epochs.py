"""What every epoch does and reports, for one model (training/train.py) and for the seeds trained
together (seeds/vectorized.py) alike: the seeding rule that makes each seed equal its separate
run, the epoch's statistics from one host sync, the non-finite guard, the history row."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from batchlab.config import TrainConfig
from batchlab.data import Dataset
from batchlab.training.gns import NoiseScale, Trajectory
from batchlab.training.strategy import Strategy


class NonFiniteError(RuntimeError):
    """Gradients stayed NaN/inf for too many consecutive steps, or the val loss was never finite."""


def epoch_order(seed: int, epoch: int, n_rows: int) -> torch.Tensor:
    """The epoch's order of the train rows, seeded per epoch so a resumed run replays it; the seeds
    trained together (seeds/vectorized.py) draw theirs here too, so each equals its separate run."""
    return torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


def dropout_seed(seed: int, epoch: int, rank: int) -> int:
    """The seed of the epoch's dropout masks: per epoch (resume) and per rank (DDP)."""
    return seed * 7919 + epoch * 131 + rank


@dataclass(frozen=True)
class EpochStats:
    train_loss: float
    norm_mean: float
    norm_var: float
    nonfinite: int
    worst_nonfinite_run: int
    last_nonfinite_run: int


def epoch_stats(losses: torch.Tensor, norms: torch.Tensor, strategy: Strategy, run_before: int) -> EpochStats:
    """Mean train loss over ranks, and the gradient norm's mean/variance over the finite steps
    (`losses`, `norms`: one value per step).

    Runs of non-finite steps continue the `run_before` steps that ended the previous epoch.
    """
    train_loss = strategy.mean_across_ranks(losses.float().mean()).item()
    norm = norms.float().cpu()
    finite = torch.isfinite(norm)
    ok = norm[finite]
    worst = run = run_before
    for bad in (~finite).tolist():
        run = run + 1 if bad else 0
        worst = max(worst, run)
    return EpochStats(
        train_loss=train_loss,
        norm_mean=ok.mean().item() if ok.numel() else 0.0,
        norm_var=ok.var(unbiased=False).item() if ok.numel() else 0.0,
        nonfinite=int((~finite).sum()),
        worst_nonfinite_run=worst,
        last_nonfinite_run=run,
    )


def check_finite(
    stats: EpochStats, epoch: int, tc: TrainConfig, dataset: Dataset, strategy: Strategy, who: str = ""
) -> None:
    """Stop a run whose gradients stayed non-finite for train.max_nonfinite_steps steps in a row."""
    if stats.worst_nonfinite_run >= tc.max_nonfinite_steps:
        raise NonFiniteError(
            f"{who}{stats.worst_nonfinite_run} consecutive steps had non-finite gradients by epoch {epoch + 1} "
            f"(limit train.max_nonfinite_steps={tc.max_nonfinite_steps}); {likely_cause(dataset, strategy)}"
        )


def epoch_row(
    epoch: int,
    stats: EpochStats,
    val_logits: torch.Tensor,
    y_val: torch.Tensor,
    rows: int,
    seconds: float,
    lr: float,
    strategy: Strategy,
    noise: NoiseScale,
) -> dict[str, float]:
    """An epoch's figures as the history and MLflow record them; `rows` trained in `seconds`."""
    return {
        "epoch": float(epoch + 1),
        "train_loss": stats.train_loss,
        "val_loss": F.cross_entropy(val_logits, y_val).item(),
        "val_accuracy": (val_logits.argmax(1) == y_val).float().mean().item(),
        "samples_per_s": rows / seconds,
        "epoch_seconds": seconds,
        "peak_memory_mb": strategy.peak_memory_mb(),
        "grad_norm_mean": stats.norm_mean,
        "grad_norm_var": stats.norm_var,
        "nonfinite_steps": float(stats.nonfinite),
        "lr": lr,
        **noise.metrics(),  # gns.b_simple, gns.grad_sq, gns.trace_sigma: EMAs at the epoch's end
    }


def likely_cause(dataset: Dataset, strategy: Strategy) -> str:
    """Why training went non-finite: bad inputs if any, otherwise the optimisation."""
    bad = [name for name in ("train", "val") if not np.isfinite(getattr(dataset, name).x).all()]
    if bad:
        return f"the {'/'.join(bad)} inputs contain NaN/inf values: fix the data, then `batchlab generate`"
    return strategy.divergence_hint()


# a val point scored within an epoch: (global step, val loss, the flat weights with train.curve_weights)
Scored = tuple[int, torch.Tensor, torch.Tensor | None]


@dataclass
class EpochSteps:
    """One epoch's optimizer steps, handed to its statistics: the per-micro-batch losses, the
    per-step gradient norms, the val losses scored within it (Scored: the global step, the loss, the
    weights under train.curve_weights), its seconds without that scoring, and, under the adaptive
    batch, the noise scale read at the batch's decisions within it."""

    losses: list[torch.Tensor] = field(default_factory=list)
    norms: list[torch.Tensor] = field(default_factory=list)
    scored: list[Scored] = field(default_factory=list)
    seconds: float = 0.0
    path: Trajectory = field(default_factory=lambda: Trajectory([], []))


def val_curve_points(
    scored: list[Scored], noise: Trajectory, examples_at: Callable[[int], int]
) -> list[dict[str, float]]:
    """An epoch's val points, read back in one sync, with the examples seen and the noise scale at
    each point's step (and the step whose weights that reading measured)."""
    losses = torch.stack([loss for _, loss, _ in scored]).tolist() if scored else []
    return [
        {"step": float(step), "examples": float(examples_at(step)), "val_loss": loss,
         "gns.b_simple": noise.at(step), "gns.measured_at": noise.measured_at(step)}
        for (step, _, _), loss in zip(scored, losses, strict=True)
    ]
