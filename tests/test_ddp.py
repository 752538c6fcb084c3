"""Real multi-process DDP (gloo on CPU) through `batchlab train`, as dvc.yaml calls it."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from mlflow import MlflowClient

from tests.conftest import env_with_venv, free_port, run, set_params, wait_until

pytestmark = pytest.mark.e2e
DDP = {"strategy": "ddp", "nproc": 2, "threads": 1}


def _weights(repo: Path) -> dict[str, torch.Tensor]:
    return torch.load(repo / "models/model.pt", weights_only=True)["state_dict"]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _rank_process(launcher: subprocess.Popen[bytes], rank: int) -> psutil.Process:
    def find() -> psutil.Process | None:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                if child.environ().get("LOCAL_RANK") == str(rank):
                    return child
        return None

    return wait_until(find, f"rank {rank} to start", interval=0.1, process=launcher)


def _wait_for_epoch(checkpoint: Path, epoch: int, proc: subprocess.Popen[bytes]) -> None:
    wait_until(
        lambda: torch.load(checkpoint, weights_only=True)["state"]["epoch"] >= epoch,
        f"a checkpoint of epoch {epoch}",
        interval=0.05,
        process=proc,
    )


def test_ddp_two_ranks_matches_single_process_and_logs_one_run(repo_copy: Path) -> None:
    run(["batchlab", "generate"], repo_copy)
    run(["batchlab", "train"], repo_copy)
    single = _weights(repo_copy)
    set_params(repo_copy, "train", **DDP)
    set_params(repo_copy, "tracking", enabled=True)
    out = run(["batchlab", "train"], repo_copy)
    assert _max_diff(single, _weights(repo_copy)) < 1e-5
    client = MlflowClient(f"sqlite:///{repo_copy / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("batchlab").experiment_id])
    assert len(runs) == 1, "every rank opened a run"
    run_id = json.loads((repo_copy / "reports/train.json").read_text())["run_id"]
    assert runs[0].info.run_id == run_id and runs[0].info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "val_loss")] == [1, 2, 3, 4]
    assert runs[0].data.tags["train.world_size"] == "2" and runs[0].data.tags["train.strategy"] == "ddp"
    assert out.stderr.count("epoch 4/4") == 1  # only rank 0 reports


def test_killed_rank_is_restarted_and_resumes_to_the_same_weights(repo_copy: Path) -> None:
    set_params(repo_copy, "train", **DDP, epochs=60, batch_size=16, max_restarts=1)
    killed_rank_resumes_to_the_same_weights(repo_copy)


def killed_rank_resumes_to_the_same_weights(repo_copy: Path) -> None:
    """Train once; train again with rank 1 SIGKILLed at epoch 3: torchrun restarts the ranks, they
    resume from the checkpoint and end on exactly the first run's weights."""
    run(["batchlab", "generate"], repo_copy)
    run(["batchlab", "train"], repo_copy)
    expected = _weights(repo_copy)
    (repo_copy / "models/model.pt").unlink()

    launcher = subprocess.Popen(["batchlab", "train"], cwd=repo_copy, env=env_with_venv(), stderr=subprocess.PIPE)
    _wait_for_epoch(repo_copy / ".batchlab/checkpoints/train.pt", 3, launcher)
    _rank_process(launcher, 1).kill()
    _, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err.decode()[-3000:]
    assert "resuming from" in err.decode()
    assert _max_diff(expected, _weights(repo_copy)) == 0.0


def test_hung_rank_fails_within_dist_timeout_with_a_clear_error(repo_copy: Path) -> None:
    set_params(repo_copy, "train", **DDP, epochs=500, batch_size=16, dist_timeout_s=5)
    run(["batchlab", "generate"], repo_copy)
    launcher = subprocess.Popen(["batchlab", "train"], cwd=repo_copy, env=env_with_venv(), stderr=subprocess.PIPE)
    _wait_for_epoch(repo_copy / ".batchlab/checkpoints/train.pt", 1, launcher)
    rank0, rank1 = _rank_process(launcher, 0), _rank_process(launcher, 1)
    rank1.send_signal(signal.SIGSTOP)  # a real hang: the process is alive but never answers
    try:
        rank0.wait(timeout=120)
    finally:
        rank1.send_signal(signal.SIGCONT)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 1
    text = err.decode()
    assert "a collective did not finish within train.dist_timeout_s=5 s" in text
    assert "batchlab: error: distributed training failed: torchrun exited" in text


def test_two_launchers_act_as_two_machines(repo_copy: Path) -> None:
    run(["batchlab", "generate"], repo_copy)
    run(["batchlab", "train"], repo_copy)
    single = _weights(repo_copy)
    (repo_copy / "models/model.pt").unlink()
    port = free_port()
    params = yaml.safe_load((repo_copy / "params.yaml").read_text())
    launchers = []
    for node in (0, 1):
        params["train"].update(strategy="ddp", nproc=1, nnodes=2, node_rank=node, rdzv_endpoint=f"127.0.0.1:{port}")
        (repo_copy / f"node{node}.yaml").write_text(yaml.safe_dump(params))
        launchers.append(
            subprocess.Popen(
                ["batchlab", "--params", f"node{node}.yaml", "train"],
                cwd=repo_copy,
                env=env_with_venv(),
                stderr=subprocess.PIPE,
            )
        )
    errors = [p.communicate(timeout=300)[1].decode() for p in launchers]
    assert [p.returncode for p in launchers] == [0, 0], "\n".join(e[-2000:] for e in errors)
    assert "epoch 4/4" in errors[0] and "epoch 4/4" not in errors[1]  # node 0 hosts rank 0
    assert _max_diff(single, _weights(repo_copy)) < 1e-5
