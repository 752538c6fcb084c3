"""Real multi-process FSDP2 (`fully_shard`, gloo on CPU) through `batchlab train`, with its sharded
(DCP) checkpoints: equal to DDP and one process, resumable after a kill, loadable at world size 1."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from batchlab import data
from batchlab.config import load_config
from batchlab.training.checkpoint import SHARDED_META, latest_epoch
from batchlab.training.strategy import Strategy
from batchlab.training.train import fit
from tests.support import REPO, env_with_venv, run, set_params, wait_until, write_params
from tests.support.ranks import DDP, max_diff, rank_process, trained_weights

pytestmark = pytest.mark.e2e
FSDP = {**DDP, "strategy": "fsdp"}
# long enough that the kills below land mid-run: an epoch (13 steps and a DCP save) takes ~0.3 s
LONG = {**FSDP, "epochs": 16, "max_restarts": 1}
CHECKPOINTS = Path(".batchlab/checkpoints")


def _wait_for_epoch(repo: Path, epoch: int, proc: subprocess.Popen[bytes]) -> Path:
    """The newest complete epoch folder of the sharded checkpoint, once it holds `epoch` or later."""

    def reached() -> Path | None:
        newest = latest_epoch(repo / CHECKPOINTS / "train.dcp")
        if newest is None:
            return None
        meta = torch.load(newest / SHARDED_META, weights_only=True)
        return newest if meta["state"]["epoch"] >= epoch else None

    return wait_until(reached, f"a sharded checkpoint of epoch {epoch}", interval=0.05, process=proc)


# the docs' figure (README, docs/strategies.md): DDP and FSDP end within this of one process at
# model.dropout 0, after the default params' whole run (20 epochs, 860 steps): 1.5e-7 measured on
# one machine here, 3.0e-5 on another (AMD EPYC, AVX-512), the same code and data: the ranks'
# summation order, amplified by 860 Adam steps as far as the CPU's kernels round
EQUAL_WITHIN = 1e-4


def test_fsdp_ddp_and_single_process_end_equal_at_the_default_params_and_fsdp_passes_onnx_parity(
    repo_copy: Path,
) -> None:
    """params.yaml as shipped, but model.dropout 0 (with dropout each rank draws its own masks) and one
    thread a process (the reduction order: a neighbour's load would otherwise move it): every epoch."""
    defaults = yaml.safe_load((REPO / "params.yaml").read_text())
    defaults["model"]["dropout"] = 0.0
    defaults["train"]["threads"] = 1
    defaults["tracking"]["enabled"] = False
    write_params(repo_copy, defaults)
    run(["batchlab", "generate"], repo_copy)
    run(["batchlab", "train"], repo_copy)
    single = trained_weights(repo_copy)
    assert json.loads((repo_copy / "reports/train_summary.json").read_text())["epochs_run"] == 20
    set_params(repo_copy, "train", **DDP)
    run(["batchlab", "train"], repo_copy)
    ddp = trained_weights(repo_copy)
    set_params(repo_copy, "train", **FSDP)
    out = run(["batchlab", "train"], repo_copy)
    fsdp = trained_weights(repo_copy)
    assert max_diff(single, ddp) < EQUAL_WITHIN and max_diff(single, fsdp) < EQUAL_WITHIN
    assert max_diff(ddp, fsdp) == 0.0  # the same reduction: FSDP's gathered weights are DDP's to the bit
    assert out.stderr.count("epoch 20/20") == 1  # only rank 0 reports
    assert not (repo_copy / CHECKPOINTS / "train.dcp").exists()  # a finished training leaves no checkpoint
    run(["batchlab", "export"], repo_copy)  # fails unless onnxruntime agrees with torch within export.atol
    report = json.loads((repo_copy / "reports/export.json").read_text())
    assert report["max_abs_diff"] <= report["atol"]


def test_killed_fsdp_rank_resumes_to_the_same_weights_and_its_checkpoint_resumes_in_one_process(
    repo_copy: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    set_params(repo_copy, "train", **LONG)
    run(["batchlab", "generate"], repo_copy)
    run(["batchlab", "train"], repo_copy)
    expected = trained_weights(repo_copy)
    (repo_copy / "models/model.pt").unlink()

    launcher = subprocess.Popen(["batchlab", "train"], cwd=repo_copy, env=env_with_venv(), stderr=subprocess.PIPE)
    try:
        _wait_for_epoch(repo_copy, 2, launcher)
        ranks = [rank_process(launcher, r) for r in (0, 1)]
        for proc in ranks:  # frozen while the checkpoint is copied for the one-process resume below
            proc.suspend()
        # the newest once frozen: the one seen may have given way to the next epoch's meanwhile
        # (CI, load 3: "No such file or directory: .../train.dcp/epoch-0002")
        saved = _wait_for_epoch(repo_copy, 2, launcher)
        folder = tmp_path / "copy" / "train.dcp"
        shutil.copytree(saved, folder / saved.name)
        for proc in ranks:
            proc.resume()
        ranks[1].kill()
        _, err = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            for child in psutil.Process(launcher.pid).children(recursive=True):
                child.kill()
            launcher.kill()
    assert launcher.returncode == 0, err.decode()[-3000:]
    assert "resuming from" in err.decode() and "train.dcp/epoch-" in err.decode()
    assert max_diff(expected, trained_weights(repo_copy)) == 0.0  # same world size: exact

    # the 2-rank checkpoint in one unsharded process, under the fingerprint it was saved with
    cfg = load_config(repo_copy / "params.yaml")
    torch.set_num_threads(1)
    one = Strategy(torch.device("cpu"), sharded=True)  # world size 1: the whole batch in one process
    with caplog.at_level(logging.INFO, logger="batchlab.training.sharded"):
        result = fit(cfg, data.load(repo_copy / "data/prepared"), one, checkpoint=folder.with_suffix(".pt"))
    assert f"resuming from {folder / saved.name}" in caplog.text
    assert len(result.history) == LONG["epochs"]
    weights = {k: v.detach() for k, v in result.model.state_dict().items()}
    assert max_diff(expected, weights) < 1e-5


# fp16: the sharded grad scaler (found_inf all-reduced) under a fused optimizer; bf16: FSDP's
# MixedPrecisionPolicy (bf16 parameters) against autocast over fp32 weights on one process.
# Rounding differs with the rows per matmul (8 per rank vs 16): measured 6e-5 (fp16), 5e-3 (bf16,
# without accumulation)
@pytest.mark.parametrize(("precision", "tolerance"), [("fp16", 1e-3), ("bf16", 2e-2)])
def test_fsdp_mixed_precision_with_accumulation_matches_one_process(
    repo_copy: Path, precision: str, tolerance: float
) -> None:
    # gradients accumulated unsharded over 2 micro-batches before one reduce-scatter
    mixed = {"precision": precision, "grad_accum_steps": 2}
    set_params(repo_copy, "train", **mixed)
    run(["batchlab", "generate"], repo_copy)
    run(["batchlab", "train"], repo_copy)
    single = trained_weights(repo_copy)
    set_params(repo_copy, "train", **FSDP, **mixed)
    run(["batchlab", "train"], repo_copy)
    diff = max_diff(single, trained_weights(repo_copy))
    assert diff < tolerance, diff
