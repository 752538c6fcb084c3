"""The seeds' local-CBS branches trained together (seeds/branches.py) give each seed what its
branch trained alone gives (training/branch.branch_loss): the MLP within 1e-6, any other module
within 1e-5 (fp32, CPU), dropout on, from base runs trained together to the point (fit_seeds's
`until`) as `fit` trains them alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchlab.config import Config
from batchlab.data import Dataset, build
from batchlab.seeds import vectorized
from batchlab.seeds.branches import branch_losses
from batchlab.training.branch import branch_loss
from batchlab.training.strategy import session
from batchlab.training.train import fit
from tests.seeds.test_vectorized_generic import _configs, _dataset
from tests.support import tiny_config


def _base_runs(cfgs: list[Config], dataset: Dataset, folder: Path, until: int) -> list[Path]:
    """The seeds' runs to epoch `until` trained together, each checkpoint checked against its run alone."""
    together = [folder / f"seed{c.train.seed}.pt" for c in cfgs]
    with session(cfgs[0].train) as strategy:
        results = vectorized.fit_seeds(cfgs, dataset, strategy, checkpoints=list[Path | None](together), until=until)
    assert [len(r.history) for r in results] == [until] * len(cfgs)
    for cfg, path, result in zip(cfgs, together, results, strict=True):
        alone = folder / f"alone{cfg.train.seed}.pt"
        with session(cfg.train) as strategy:
            separate = fit(cfg, dataset, strategy, checkpoint=alone, until=until)
        assert torch.load(path, weights_only=True)["state"]["epoch"] == until
        assert separate.history[-1]["val_loss"] == pytest.approx(result.history[-1]["val_loss"], abs=1e-5)
    return together


@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
def test_seeds_branched_together_equal_each_seeds_branch_alone(kind: str, tmp_path: Path) -> None:
    """Each multiplier's branch from epoch 1 over 1.5 epochs' rows (a schedule with warmup and
    cosine decay crossed, dropout on): every seed's val loss is its branch's alone."""
    if kind == "mlp":
        cfgs = [
            tiny_config(model={"dropout": 0.2}, train={"epochs": 3, "batch_size": 16, "seed": s}) for s in (0, 1, 2)
        ]
        dataset, tol = build(cfgs[0].data)[0], 1e-6
    else:
        cfgs, tol = _configs(kind, (0, 1, 2), batch_size=16, gns=False), 1e-5
        dataset = _dataset(cfgs[0])
    checkpoints = _base_runs(cfgs, dataset, tmp_path, until=1)
    examples = 3 * dataset.train.y.shape[0] // 2 // 64 * 64  # whole batches of 16, 32 and 64
    for multiplier in (1, 2, 4):
        together = branch_losses(cfgs, dataset, checkpoints, multiplier, examples)
        for cfg, path, loss in zip(cfgs, checkpoints, together, strict=True):
            alone = branch_loss(cfg, dataset, torch.load(path, weights_only=True), multiplier, examples)
            assert abs(loss - alone) <= tol * max(1.0, abs(alone)), (kind, multiplier, cfg.train.seed, loss, alone)
        assert len(set(together)) == len(cfgs)  # the seeds' branches differ: each took its own rows and masks


def test_branches_refuse_checkpoints_of_different_epochs(tiny_dataset: Dataset, tmp_path: Path) -> None:
    cfgs = [tiny_config(train={"epochs": 3, "seed": s}) for s in (0, 1)]
    paths = []
    for cfg, until in zip(cfgs, (1, 2), strict=True):
        paths.append(tmp_path / f"seed{cfg.train.seed}.pt")
        with session(cfg.train) as strategy:
            fit(cfg, tiny_dataset, strategy, checkpoint=paths[-1], until=until)
    with pytest.raises(ValueError, match="hold no common epoch"):
        branch_losses(cfgs, tiny_dataset, paths, 1, 64)
