"""What the launcher hands torchrun: arguments and the ranks' environment."""

from __future__ import annotations

import socket
import sys

import psutil
import pytest

from batchlab import launch
from batchlab.config import TrainConfig
from tests.conftest import tiny_config


def _train(**values: object) -> TrainConfig:
    return tiny_config(train={"strategy": "ddp", **values}).train


def test_one_machine_uses_a_standalone_rendezvous() -> None:
    args = launch.torchrun_args(_train(nproc=2, max_restarts=1))
    assert args == ["--nproc-per-node", "2", "--max-restarts", "1", "--standalone"]


def test_several_machines_use_a_static_rendezvous_at_the_endpoint() -> None:
    args = launch.torchrun_args(_train(nproc=1, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.5:29400"))
    assert args == [
        "--nproc-per-node", "1", "--max-restarts", "0",
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.5", "--master-port", "29400",
    ]  # fmt: skip


def test_one_machine_launches_torchrun_with_its_stores_on_loopback() -> None:
    cmd = launch.launch_command(_train(nproc=2), ["train"])
    assert cmd[:3] == [sys.executable, "-m", "batchlab.loopback"]
    assert cmd[-3:] == ["-m", "batchlab.cli", "train"]


def test_several_machines_launch_plain_torchrun() -> None:
    cmd = launch.launch_command(_train(nnodes=2, rdzv_endpoint="10.0.0.5:29400"), ["train"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]


def test_one_machine_ranks_are_told_to_listen_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")  # set for multi-machine runs: a lone machine overrides it
    env = launch.worker_env(_train(nproc=2), run_id=None)
    assert env["BATCHLAB_LOOPBACK"] == "1"
    loopback_addrs = {a.address for a in psutil.net_if_addrs()[env["GLOO_SOCKET_IFNAME"]] if a.family == socket.AF_INET}
    assert "127.0.0.1" in loopback_addrs


def test_several_machines_ranks_listen_where_the_user_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    monkeypatch.setenv("BATCHLAB_LOOPBACK", "1")  # e.g. a launcher started from inside a rank
    env = launch.worker_env(_train(nnodes=2), run_id=None)
    assert "BATCHLAB_LOOPBACK" not in env
    assert env["GLOO_SOCKET_IFNAME"] == "eth0"


def test_worker_env_shares_cores_between_ranks_and_passes_the_run_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    monkeypatch.setenv(launch.RUN_ID_ENV, "stale")
    env = launch.worker_env(_train(nproc=2, threads=0), run_id=None)
    assert env["OMP_NUM_THREADS"] == "4"
    assert launch.RUN_ID_ENV not in env
    assert launch.worker_env(_train(nproc=2), run_id="abc")[launch.RUN_ID_ENV] == "abc"


def test_ranks_do_not_share_the_agent_store_unless_the_user_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    assert launch.worker_env(_train(nproc=2), run_id=None)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")
    assert launch.worker_env(_train(nproc=2), run_id=None)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "0"
