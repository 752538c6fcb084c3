"""Single-machine DDP listens on loopback only: no port of a training run is open to the network."""

from __future__ import annotations

import datetime as dt
import gc
import ipaddress
import socket
import subprocess
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, c10d_rendezvous_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from batchlab.training import loopback
from tests.support import env_with_venv, free_port, run, set_params
from tests.support.ranks import DDP, rank_process, wait_for_epoch


def _listening(proc: psutil.Process) -> list[tuple[str, int]]:
    return [c.laddr for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]


def _is_loopback(host: str) -> bool:
    return ipaddress.ip_address(host.split("%")[0]).is_loopback


def _hosts_listening_on(port: int) -> set[str]:
    return {host for host, p in _listening(psutil.Process()) if p == port}


def _non_loopback_interface() -> str | None:
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and not _is_loopback(a.address) for a in addrs):
            return name
    return None


TIMEOUT = dt.timedelta(seconds=30)


def test_rank_store_listens_on_loopback_only_and_serves_the_other_ranks() -> None:
    port = free_port()
    hosted = loopback.rank_store(0, 1, port, TIMEOUT)
    client = loopback.rank_store(1, 1, port, TIMEOUT)
    client.set("key", "from rank 1")
    assert hosted.get("key") == b"from rank 1"
    assert _hosts_listening_on(port) == {"127.0.0.1"}


def test_a_restart_round_can_host_its_store_on_the_port_the_last_round_used() -> None:
    port = free_port()
    hosted, client = loopback.rank_store(0, 1, port, TIMEOUT), loopback.rank_store(1, 1, port, TIMEOUT)
    client.set("key", "value")
    del hosted, client  # the server closes first: its connections linger in TIME_WAIT on `port`
    gc.collect()
    assert loopback.rank_store(0, 1, port, TIMEOUT).port == port


def test_agent_stores_listen_on_loopback_only_inside_the_context() -> None:
    with loopback.agent_stores_on_loopback():
        # what torchrun --standalone's agent makes: the c10d rendezvous store on localhost:0 ...
        rdzv = c10d_rendezvous_backend._create_tcp_store(RendezvousParameters("c10d", "localhost:0", "run", 1, 1))
        # ... and, unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, the store it shares with the ranks
        shared = DynamicRendezvousHandler._create_tcp_store_server(None, "localhost", 0)  # type: ignore[arg-type]
    assert _hosts_listening_on(rdzv.port) == {"127.0.0.1"}
    assert _hosts_listening_on(shared.port) == {"127.0.0.1"}
    assert c10d_rendezvous_backend.TCPStore is dist.TCPStore  # torch is itself again outside


@pytest.mark.e2e
def test_single_node_ddp_listens_on_loopback_only(repo_copy: Path) -> None:
    set_params(repo_copy, "train", **DDP, epochs=500, batch_size=16)  # trains long enough to be looked at
    run(["batchlab", "generate"], repo_copy)
    # gloo's sockets bind where the hostname resolves (loopback on some machines): point gloo at a
    # real interface, as a user's environment might, to see that a one-machine run overrides it
    other = _non_loopback_interface()
    env = env_with_venv(GLOO_SOCKET_IFNAME=other) if other else env_with_venv()
    launcher = subprocess.Popen(["batchlab", "train"], cwd=repo_copy, env=env, stderr=subprocess.PIPE)
    tree = [psutil.Process(launcher.pid)]
    try:
        # a checkpoint of epoch 1: both ranks have joined the group and all-reduced, so every store
        # and every gloo pair is up
        wait_for_epoch(repo_copy / ".batchlab/checkpoints/train.pt", 1, launcher)
        rank0 = rank_process(launcher, 0)
        tree += tree[0].children(recursive=True)
        sockets = {p.pid: _listening(p) for p in tree}
        commands = {p.pid: f"pid {p.pid} {' '.join(p.cmdline()[1:4])}" for p in tree}
        master_port = int(rank0.environ()["MASTER_PORT"])
    finally:
        for proc in reversed(tree):
            proc.kill()
        launcher.communicate(timeout=60)
    assert master_port in {port for _, port in sockets[rank0.pid]}, sockets  # rank 0 hosts the group's store
    exposed = {commands[pid]: addrs for pid, addrs in sockets.items() if any(not _is_loopback(h) for h, _ in addrs)}
    assert not exposed, f"listening beyond loopback: {exposed}"
