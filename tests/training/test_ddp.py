"""Real multi-process DDP (gloo on CPU) through `batchlab train`, as dvc.yaml calls it."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from tests.support import env_with_venv, free_port, run, set_params
from tests.support.ranks import (
    DDP,
    killed_rank_resumes_to_the_same_weights,
    max_diff,
    rank_process,
    trained_weights,
    wait_for_epoch,
)

pytestmark = pytest.mark.e2e


def test_ddp_two_ranks_matches_single_process_and_logs_one_run(repo_copy: Path) -> None:
    run(["batchlab", "generate"], repo_copy)
    run(["batchlab", "train"], repo_copy)
    single = trained_weights(repo_copy)
    set_params(repo_copy, "train", **DDP)
    set_params(repo_copy, "tracking", enabled=True)
    out = run(["batchlab", "train"], repo_copy)
    assert max_diff(single, trained_weights(repo_copy)) < 1e-5
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


def test_hung_rank_fails_within_dist_timeout_with_a_clear_error(repo_copy: Path) -> None:
    set_params(repo_copy, "train", **DDP, epochs=500, batch_size=16, dist_timeout_s=5)
    run(["batchlab", "generate"], repo_copy)
    launcher = subprocess.Popen(["batchlab", "train"], cwd=repo_copy, env=env_with_venv(), stderr=subprocess.PIPE)
    wait_for_epoch(repo_copy / ".batchlab/checkpoints/train.pt", 1, launcher)
    rank0, rank1 = rank_process(launcher, 0), rank_process(launcher, 1)
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
    single = trained_weights(repo_copy)
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
    assert max_diff(single, trained_weights(repo_copy)) < 1e-5
