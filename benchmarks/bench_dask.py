"""The sweep on a Dask cluster against the local executor: 12 experiments (4 batch sizes x 3 seeds)
on `dask scheduler` + 2 `dask worker --nthreads 1` (with a `prefect server` they report to) against
one local lane, every experiment on one torch thread. The workers are warmed by a 2-experiment
sweep first (a long-lived cluster pays its imports once); that cold start is reported apart.
Reports the wall-time ratio, the fixed cost of the Dask path (from `batchlab sweep` to the first
experiment starting on a worker) and its cost per task: worker time between experiments."""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from batchlab.config import load_config
from common import BIN, REPO, Table, cli_env, markdown, progress, run_cli, verdict

WORKERS = 2
RATIO_TARGET = 1.7  # issue #14: 2 workers x 1 thread against one local lane, on 2 cores
# one task per experiment (no seed groups), so each result's own times tell where a worker's time went
SWEEP = {"batch_sizes": [16, 32, 64, 128], "seeds": [0, 1, 2], "epochs": 100, "parallel": 1, "vectorize_seeds": False}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(check: Any, what: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.5)


def _answers(url: str) -> bool:
    try:
        return urllib.request.urlopen(url, timeout=2).status == 200
    except OSError:
        return False


@contextmanager
def cluster(folder: Path) -> Iterator[tuple[str, str]]:
    """A Prefect server, a Dask scheduler and WORKERS one-thread workers; yields (API URL, scheduler)."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, cmd: list[str], **env: str) -> subprocess.Popen[bytes]:
        with open(folder / f"{name}.log", "w") as log:
            proc = subprocess.Popen(
                cmd, env=cli_env(**env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        procs.append(proc)
        return proc

    try:
        api_port, port = _port(), _port()
        api = f"http://127.0.0.1:{api_port}/api"
        cmd = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(api_port)]
        server = start("prefect", cmd, PREFECT_HOME=str(folder / "prefect"), PREFECT_UI_ENABLED="false")
        _wait(lambda: _answers(f"{api}/health"), "prefect server", server)
        address = f"tcp://127.0.0.1:{port}"
        scheduler = start("scheduler", [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port),
                                        "--no-dashboard"])  # fmt: skip
        _wait(lambda: "Scheduler at:" in (folder / "scheduler.log").read_text(), "dask scheduler", scheduler)
        for i in range(WORKERS):
            cmd = [str(BIN / "dask"), "worker", address, "--nthreads", "1", "--no-dashboard", "--name", f"w{i}"]
            worker = start(f"w{i}", cmd, PREFECT_API_URL=api, DASK_DISTRIBUTED__WORKER__DAEMON="False")
            _wait(lambda i=i: "Registered to:" in (folder / f"w{i}.log").read_text(), f"dask worker {i}", worker)
        yield api, address
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)


def sweep_folder(folder: Path, **sweep: Any) -> Path:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["train"]["threads"] = 1  # one core per experiment: the lanes compare, not torch's threads
    params["tracking"]["enabled"] = False  # bench_sweep measures tracking
    params["sweep"].update(SWEEP, **sweep)
    folder.mkdir(parents=True)
    (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    load_config(folder / "params.yaml")  # a bad params file fails here, not in a worker
    run_cli(["batchlab", "generate"], folder)
    return folder


def results(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("sweep/experiments/*/result.json"))]


def timed_sweep(folder: Path, **env: str) -> tuple[float, float, list[dict[str, Any]]]:
    """Wall seconds of `batchlab sweep`, its start (epoch seconds) and its experiments' results."""
    started = time.time()
    return run_cli(["batchlab", "sweep"], folder, **env), started, results(folder)


def main() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        progress("dask: the local executor, one lane")
        local_s, _, local_rows = timed_sweep(sweep_folder(root / "local"))
        with cluster(root) as (api, address):
            progress(f"dask: {WORKERS} workers x 1 thread, warming up")
            warm = sweep_folder(root / "warm", executor="dask", dask_address=address, batch_sizes=[16], seeds=[0, 1])
            cold_s, cold_start, cold_rows = timed_sweep(warm, PREFECT_API_URL=api)
            progress(f"dask: {WORKERS} workers x 1 thread")
            dask = sweep_folder(root / "dask", executor="dask", dask_address=address)
            dask_s, start, dask_rows = timed_sweep(dask, PREFECT_API_URL=api)
    n = len(dask_rows)
    # on the workers: each experiment ran from finished_at - (train_seconds + overhead_seconds)
    spans = [(r["finished_at"] - r["train_seconds"] - r["overhead_seconds"], r["finished_at"]) for r in dask_rows]
    first, last = min(b for b, _ in spans), max(e for _, e in spans)
    busy = sum(e - b for b, e in spans)
    per_task = (WORKERS * (last - first) - busy) / n  # idle worker time between experiments, per experiment
    fixed = first - start
    cold_fixed = min(r["finished_at"] - r["train_seconds"] - r["overhead_seconds"] for r in cold_rows) - cold_start
    pairs = list(zip(dask_rows, local_rows, strict=True))  # both sorted by experiment name
    in_task = sum(d["overhead_seconds"] - lo["overhead_seconds"] for d, lo in pairs) / n
    same = all(abs(d["test_f1_macro"] - lo["test_f1_macro"]) <= 1e-6 for d, lo in pairs)
    # two workers share the two cores with the scheduler, the Prefect server and the sweep's own
    # process: each experiment's training takes longer than alone
    slower = statistics.median(d["train_seconds"] / lo["train_seconds"] for d, lo in pairs)
    ratio = local_s / dask_s
    table = Table(f"Sweep executors: {n} experiments, every one on 1 torch thread",
                  ["executor", "wall s", "speed-up", "same F1 (1e-6)"])  # fmt: skip
    table.add("local, 1 lane", f"{local_s:.1f}", "1.00x", "")
    table.add(f"dask, {WORKERS} workers x 1 thread (warm)", f"{dask_s:.1f}", f"{ratio:.2f}x", "yes" if same else "NO")
    cost = Table("What the Dask path costs", ["cost", "seconds"])
    cost.add("once per sweep: `batchlab sweep` to the first experiment on a warm worker", f"{fixed:.1f}")
    cost.add("the same on cold workers (their first torch/mlflow imports)", f"{cold_fixed:.1f}")
    cost.add("per experiment: worker time between experiments (scheduling, Prefect task states)", f"{per_task:.2f}")
    cost.add("per experiment: more inside the task than locally (worker checks)", f"{in_task:.2f}")
    cost.add("per experiment: its training on a worker against alone (median ratio)", f"{slower:.2f}x")
    targets = Table("Dask targets", ["target", "measured", "result"])
    targets.add(f"speed-up ≥ {RATIO_TARGET}x", f"{ratio:.2f}x", verdict(ratio >= RATIO_TARGET))
    tables = [table.as_dict(), cost.as_dict(), targets.as_dict()]
    print(markdown(tables))
    return {"local_s": local_s, "dask_s": dask_s, "ratio": ratio, "fixed_s": fixed, "cold_fixed_s": cold_fixed,
            "per_task_s": per_task, "in_task_s": in_task, "train_slower": slower, "same_f1": same,
            "cold_wall_s": cold_s, "load_average_end": os.getloadavg()[0], "tables": tables}  # fmt: skip


if __name__ == "__main__":
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    main()
