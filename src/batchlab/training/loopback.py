"""Single-machine DDP that listens on loopback only.

torch's TCPStore server listens on every interface and has no bind-address option, so a
one-machine run would open its stores to the network. Its constructor does take
`master_listen_fd`, a socket that is already listening: we bind that socket to 127.0.0.1.
`python -m batchlab.training.loopback <torchrun args>` is torchrun with its agent's stores on
loopback; the ranks build their process group's store with `rank_store`, and gloo's own
sockets follow GLOO_SOCKET_IFNAME (`loopback_interface`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import socket
from collections.abc import Iterator
from typing import Any

import psutil
import torch.distributed as dist
import torch.distributed.run
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

LOOPBACK_ENV = "BATCHLAB_LOOPBACK"  # set to "1" by the launcher for ranks of a one-machine run
HOST = "127.0.0.1"


def requested() -> bool:
    """True in a rank whose launcher asked for loopback-only sockets."""
    return os.environ.get(LOOPBACK_ENV) == "1"


def loopback_interface() -> str:
    """The name of the interface that carries 127.0.0.1 ("lo" on Linux, "lo0" on macOS)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(addr.family == socket.AF_INET and addr.address == HOST for addr in addrs):
            return name
    return "lo"


def listen_on_loopback(port: int = 0) -> socket.socket:
    """A listening socket on 127.0.0.1:port (0: any free port), for a TCPStore server to adopt."""
    # create_server sets SO_REUSEADDR: a restart round can bind a port its dead round used
    return socket.create_server((HOST, port))


def _store(port: int, is_master: bool, **kwargs: Any) -> dist.TCPStore:
    if not is_master:
        return dist.TCPStore(HOST, port, is_master=False, **kwargs)
    server = listen_on_loopback(port)
    port = server.getsockname()[1]
    return dist.TCPStore(HOST, port, is_master=True, master_listen_fd=server.detach(), **kwargs)


def rank_store(rank: int, world_size: int, port: int, timeout: dt.timedelta) -> dist.TCPStore:
    """The process group's store on 127.0.0.1:port, the one torch's env:// rendezvous would make."""
    # rank 0 hosts it, unless torchrun's agent shares its own store with the ranks
    hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    return _store(port, hosts, world_size=world_size, timeout=timeout, multi_tenant=True)


def init_process_group(backend: str, rank: int, world_size: int, timeout: dt.timedelta) -> None:
    """This rank's process group: on one machine over a store on 127.0.0.1 only; across machines
    through torch's env:// rendezvous (a store on every interface, which other machines reach)."""
    store = rank_store(rank, world_size, int(os.environ["MASTER_PORT"]), timeout) if requested() else None
    dist.init_process_group(backend=backend, timeout=timeout, store=store, rank=rank, world_size=world_size)


def _agent_store(host_name: str, port: int, *, is_master: bool = False, **kwargs: Any) -> dist.TCPStore:
    # host_name is the rendezvous endpoint's host, "localhost" under --standalone
    return _store(port, is_master, **kwargs) if is_master else dist.TCPStore(host_name, port, **kwargs)


def _agent_store_server(_handler: object, _master_addr: str, master_port: int) -> dist.TCPStore:
    return _store(master_port, True, multi_tenant=True)


@contextlib.contextmanager
def agent_stores_on_loopback() -> Iterator[None]:
    """Inside, torchrun's agent hosts its stores on 127.0.0.1. This covers the two TCPStore
    servers a torch 2.13 agent makes: the c10d rendezvous backend's store
    (`c10d_rendezvous_backend._create_tcp_store`, which calls the module's `TCPStore`) and the
    store it shares with the ranks unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    (`DynamicRendezvousHandler._create_tcp_store_server`)."""
    saved = c10d_rendezvous_backend.TCPStore, DynamicRendezvousHandler._create_tcp_store_server
    c10d_rendezvous_backend.TCPStore = _agent_store  # type: ignore[misc,assignment]
    DynamicRendezvousHandler._create_tcp_store_server = _agent_store_server  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        c10d_rendezvous_backend.TCPStore, DynamicRendezvousHandler._create_tcp_store_server = saved  # type: ignore[misc,method-assign]


def main() -> None:
    """torchrun for one machine (`--standalone`), with every store it hosts on loopback."""
    with agent_stores_on_loopback():
        torch.distributed.run.main()


if __name__ == "__main__":
    main()
