"""Helpers for tests of real DDP and FSDP ranks through `batchlab train` (gloo on CPU)."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import psutil
import torch

from tests.support import env_with_venv, run, wait_until

DDP = {"strategy": "ddp", "nproc": 2, "threads": 1}


def trained_weights(repo: Path) -> dict[str, torch.Tensor]:
    return torch.load(repo / "models/model.pt", weights_only=True)["state_dict"]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def rank_process(launcher: subprocess.Popen[bytes], rank: int) -> psutil.Process:
    def find() -> psutil.Process | None:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                if child.environ().get("LOCAL_RANK") == str(rank):
                    return child
        return None

    return wait_until(find, f"rank {rank} to start", interval=0.1, process=launcher)


def wait_for_epoch(checkpoint: Path, epoch: int, proc: subprocess.Popen[bytes]) -> None:
    wait_until(
        lambda: torch.load(checkpoint, weights_only=True)["state"]["epoch"] >= epoch,
        f"a checkpoint of epoch {epoch}",
        interval=0.05,
        process=proc,
    )


def killed_rank_resumes_to_the_same_weights(repo_copy: Path) -> None:
    """Train once; train again with rank 1 SIGKILLed at epoch 3: torchrun restarts the ranks, they
    resume from the checkpoint and end on exactly the first run's weights."""
    run(["batchlab", "generate"], repo_copy)
    run(["batchlab", "train"], repo_copy)
    expected = trained_weights(repo_copy)
    (repo_copy / "models/model.pt").unlink()

    launcher = subprocess.Popen(["batchlab", "train"], cwd=repo_copy, env=env_with_venv(), stderr=subprocess.PIPE)
    wait_for_epoch(repo_copy / ".batchlab/checkpoints/train.pt", 3, launcher)
    rank_process(launcher, 1).kill()
    _, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err.decode()[-3000:]
    assert "resuming from" in err.decode()
    assert max_diff(expected, trained_weights(repo_copy)) == 0.0
