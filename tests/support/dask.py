"""A real Dask cluster for the sweep's tests: `dask scheduler` and `dask worker` processes."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from batchlab.config import load_config
from batchlab.paths import Paths
from batchlab.sweep.run import run_sweep
from tests.support import (
    BIN,
    MlflowServer,
    env_with_venv,
    free_port,
    merge,
    mlflow_on_postgres,
    prefect_home,
    wait_until,
    write_params,
)


@dataclass
class Cluster:
    """`dask scheduler` and `dask worker` processes, each in its own process group."""

    folder: Path
    env: dict[str, str]
    address: str = ""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    cwd: Path | None = None  # where the workers start: a user's model.factory imports from there

    def start(self, name: str, cmd: list[str], ready: str, **env: str) -> None:
        """Start `name`, its output appended to <name>.log (a restarted one's after its last life's)."""
        log = self.folder / f"{name}.log"
        with open(log, "ab") as out:
            since = out.tell()
            self.procs[name] = subprocess.Popen(
                cmd, env={**self.env, **env}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.cwd
            )
        started = lambda: ready in log.read_bytes()[since:].decode(errors="replace")  # noqa: E731
        wait_until(started, f"{name} to start", process=self.procs[name], log=log)

    def scheduler(self, **env: str) -> None:
        port = free_port()
        self.address = f"tcp://127.0.0.1:{port}"
        cmd = [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"]
        self.start("scheduler", cmd, "Scheduler at:", **env)

    def worker(self, name: str, nanny: bool = True, **env: str) -> None:
        # one experiment at a time per worker; non-daemonic, so experiments may start torchrun
        cmd = [str(BIN / "dask"), "worker", self.address, "--name", name, "--nthreads", "1", "--no-dashboard"]
        cmd += [] if nanny else ["--no-nanny"]  # without one, a worker the scheduler removed is not killed
        self.start(name, cmd, "Registered to:", DASK_DISTRIBUTED__WORKER__DAEMON="False", **env)

    def warm(self) -> None:
        """Every live worker imports what a sweep's task runs (torch, batchlab, Prefect's engine), so
        the first tasks of a test's sweep start together: a worker that ran the sweep's clock is warm,
        and a cold one started its first experiment some 15 s after (loaded CI), too late to train
        beside the other."""
        from distributed import Client

        with Client(self.address, timeout=60) as client:
            client.run(exec, "import batchlab.sweep.cluster, batchlab.sweep.groups")

    def pause(self, name: str) -> None:
        """SIGSTOP: the worker holds what it was given and runs nothing until `resume`."""
        os.killpg(self.procs[name].pid, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        if self.procs[name].poll() is None:
            os.killpg(self.procs[name].pid, signal.SIGCONT)

    def kill(self, name: str) -> None:
        """The worker (nanny and its process) dies at once, as when its machine goes away."""
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            self.kill(name)

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")


class PrefectServer:
    """`prefect server start` on a fixed port and home (its SQLite database): kill it, start it again."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        home = self.folder / "prefect-home"
        if not home.exists():  # the first start: a migrated database; a restart keeps its own
            prefect_home(home)
        env = env_with_venv(PREFECT_HOME=str(home), PREFECT_UI_ENABLED="false")
        env.pop("PREFECT_API_URL", None)
        log = self.folder / "prefect-server.log"
        with open(log, "a") as out:
            cmd = ["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(self.port)]
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        check = lambda: httpx.get(f"{self.api}/health", timeout=2).status_code == 200  # noqa: E731
        wait_until(check, "the Prefect server's health check", process=self.proc, log=log)

    def kill(self) -> None:
        """The server (and its uvicorn) dies at once, as when its machine goes away."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@dataclass
class Servers:
    """What a Dask sweep test runs against: a Prefect server, an MLflow server on PostgreSQL and a
    cluster (not started: each test starts the scheduler and workers it wants), with the
    environment that points `batchlab sweep` at them; `repo`, its sweep folders' template."""

    repo: Path
    cluster: Cluster
    mlflow: MlflowServer
    prefect: PrefectServer
    env: dict[str, str]


@contextlib.contextmanager
def servers(tmp: Path, repo: Path) -> Iterator[Servers]:
    """The Servers in `tmp`, each stopped afterwards (the PostgreSQL database dropped)."""
    prefect = PrefectServer(tmp)
    prefect.start()
    try:
        with mlflow_on_postgres(tmp) as mlflow:
            env = env_with_venv(PREFECT_API_URL=prefect.api, MLFLOW_TRACKING_URI=mlflow.uri)
            cluster = Cluster(tmp, env)
            try:
                yield Servers(repo, cluster, mlflow, prefect, env)
            finally:
                cluster.stop()
    finally:
        prefect.kill()


def f1_by_batch(folder: Path) -> dict[str, float]:
    with open(folder / "reports" / "sweep" / "summary.csv") as f:
        return {row["batch_size"]: float(row["test_f1_macro_mean"]) for row in csv.DictReader(f)}


# the local executor's F1 by batch size, by what decides it (the params, tracking and where the sweep
# runs left out, and the prepared data): a module's fault tests sweep the same configuration, and
# one local sweep answers them all
_LOCAL_F1: dict[str, dict[str, float]] = {}


def _local_key(cfg: dict[str, Any], data: Path) -> str:
    decided = {**cfg, "tracking": {}, "sweep": {k: v for k, v in cfg["sweep"].items() if k != "dask_address"}}
    digest = hashlib.sha256(json.dumps(decided, sort_keys=True, default=str).encode())
    for path in sorted(p for p in data.rglob("*") if p.is_file()):
        digest.update(path.relative_to(data).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()


def assert_f1_equals_the_local_executor(folder: Path, tmp_path: Path) -> None:
    """The same sweep with the local executor, tracking off: the same F1 per batch size."""
    cfg = merge(yaml.safe_load((folder / "params.yaml").read_text()), {"sweep": {"executor": "local"}})
    key = _local_key(cfg, folder / "data")
    if key not in _LOCAL_F1:
        local = tmp_path / "local"
        shutil.copytree(folder / "data", local / "data")
        write_params(local, merge(cfg, {"tracking": {"enabled": False}}))
        run_sweep(load_config(local / "params.yaml"), Paths(local))
        _LOCAL_F1[key] = f1_by_batch(local)
    dask_f1, local_f1 = f1_by_batch(folder), _LOCAL_F1[key]
    assert dask_f1.keys() == local_f1.keys() == {"16", "32"}
    for batch, f1 in local_f1.items():
        assert dask_f1[batch] == pytest.approx(f1, abs=1e-6), batch
