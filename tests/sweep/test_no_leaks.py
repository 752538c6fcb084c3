"""Whatever a command starts, it stops (#31 §2): once `batchlab train` under DDP or `batchlab sweep`
(local lanes, the Dask executor) has exited, on success, on an error and when interrupted (Ctrl-C
at a terminal: SIGINT to its process group; `kill`: SIGTERM to it alone), no process it started is
alive.

The command runs in a session of its own. While it runs, every process under it (its children,
theirs, and those that start sessions of their own, as torchrun's ranks do) and every process in
its session is recorded, every 50 ms, and once more after it exits."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from batchlab import stages
from batchlab.config import parse_config
from batchlab.paths import Paths
from tests.support import REPO, TINY, default_sigint, env_with_venv, merge, prefect_server, wait_until, write_params
from tests.support.dask import Cluster

GRACE_S = 3.0  # a process told to stop as the command ends has been reaped within this
INTERRUPT_S = 60.0  # an interrupted command has stopped what it started and exited within this
DDP = {"strategy": "ddp", "nproc": 2, "threads": 1}
DIVERGES = {"optimizer": "sgd", "lr": 1e6, "schedule": "constant"}  # NonFiniteError after 20 steps
OUTCOMES = ("success", "error", "ctrl-c", "sigterm")


@dataclass
class Watched:
    """A command in a session of its own, and every process seen under it or in its session."""

    proc: subprocess.Popen[bytes]
    log: Path
    seen: dict[int, tuple[float, str]] = field(default_factory=dict)  # pid: (create time, command line)

    def look(self) -> None:
        found: list[psutil.Process] = []
        with contextlib.suppress(psutil.Error):
            found = psutil.Process(self.proc.pid).children(recursive=True)
        for process in psutil.process_iter():
            with contextlib.suppress(OSError):
                if process.pid != self.proc.pid and os.getsid(process.pid) == self.proc.pid:
                    found.append(process)
        for process in found:
            with contextlib.suppress(psutil.Error):
                created, cmdline = process.create_time(), " ".join(process.cmdline())
                # read again while it changes: one first seen between fork and exec has its parent's
                # command line; an exiting one (a zombie) has none, and keeps what it had
                if cmdline or process.pid not in self.seen:
                    self.seen[process.pid] = (created, cmdline)

    def alive(self, pattern: str = "") -> list[str]:
        """The command lines of the processes seen that still run (and contain `pattern`)."""
        running = []
        for pid, (created, cmdline) in self.seen.items():
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                same = process.create_time() == created and process.status() != psutil.STATUS_ZOMBIE
                if same and pattern in cmdline:
                    running.append(f"{pid}: {cmdline}")
        return running

    def watch_until(self, ready: Callable[[], object], what: str, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.look()
            with contextlib.suppress(Exception):  # a file half-written: not yet
                if ready():
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"waited for {what}: exited {self.proc.poll()}\n{self.output()[-4000:]}")
            time.sleep(0.05)

    def wait(self, timeout: float) -> int:
        """The exit status, watching until then."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"still running after {timeout:.0f} s\n{self.output()[-4000:]}")
            self.look()
            time.sleep(0.05)
        self.look()  # its session once more: what a child started as the command ended
        return self.proc.returncode

    def left(self) -> list[str]:
        """What is still alive GRACE_S after the command exited."""
        deadline = time.monotonic() + GRACE_S
        while (alive := self.alive()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return alive

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill_all(self) -> None:
        """Whatever is left, so that a failed test leaves nothing for the next one."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for line in self.alive():
            with contextlib.suppress(psutil.Error):
                psutil.Process(int(line.split(":")[0])).kill()
        self.proc.wait(timeout=30)


@contextlib.contextmanager
def started(cmd: list[str], folder: Path, env: dict[str, str]) -> Iterator[Watched]:
    log = folder / "command.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=default_sigint,  # Ctrl-C as in a terminal, whatever this process ignores
        )  # fmt: skip
    watched = Watched(proc, log)
    try:
        yield watched
    finally:
        watched.kill_all()


def _prepared(folder: Path, **sections: dict[str, Any]) -> None:
    """The repo's params with TINY's and `sections`, tracking off, and their data prepared in `folder`."""
    params = merge(merge(yaml.safe_load((REPO / "params.yaml").read_text()), TINY), sections)
    stages.generate(parse_config(params), Paths(folder))
    write_params(folder, params)


def _ends(watched: Watched, outcome: str, ready: Callable[[], object], what: str) -> float:
    """Let the command end as `outcome` says; the seconds from the interruption to its exit."""
    if outcome in ("success", "error"):
        watched.wait(timeout=600)
        return 0.0
    watched.watch_until(ready, what)
    signalled = time.monotonic()
    if outcome == "ctrl-c":
        os.killpg(watched.proc.pid, signal.SIGINT)
    else:
        watched.proc.send_signal(signal.SIGTERM)
    watched.wait(timeout=INTERRUPT_S + 60)
    return time.monotonic() - signalled


def _assert_exit(watched: Watched, outcome: str, error: str, took: float) -> None:
    output = watched.output()
    if outcome == "success":
        assert watched.proc.returncode == 0, output[-4000:]
    elif outcome == "error":
        assert watched.proc.returncode == 1 and error in output, output[-4000:]
    else:
        assert watched.proc.returncode == 130 and output.strip().endswith("batchlab: interrupted"), output[-4000:]
        assert took < INTERRUPT_S, f"{took:.0f} s from the signal to the exit\n{output[-4000:]}"


def _ranks(cmdlines: Iterable[str]) -> list[str]:
    """torchrun's ranks among these command lines (torchrun's own names batchlab.cli too)."""
    return [cmd for cmd in cmdlines if "-m batchlab.cli" in cmd and "batchlab.training.loopback" not in cmd]


def _checkpoints(folder: Path, n: int) -> bool:
    return len(list(folder.glob("sweep/experiments/*/.batchlab/checkpoints/train.pt"))) >= n


@pytest.mark.e2e
@pytest.mark.parametrize("outcome", OUTCOMES)
def test_ddp_train_leaves_no_process(outcome: str, tmp_path: Path) -> None:
    train = {**DDP, "epochs": 3 if outcome == "success" else 2000, **(DIVERGES if outcome == "error" else {})}
    _prepared(tmp_path, train=train)
    with started(["batchlab", "train"], tmp_path, env_with_venv()) as watched:
        checkpoint = tmp_path / ".batchlab" / "checkpoints" / "train.pt"
        took = _ends(watched, outcome, lambda: checkpoint.is_file() and len(_ranks(watched.alive())) >= 2,
                     "both ranks training")  # fmt: skip
        ranks = _ranks(cmd for _, cmd in watched.seen.values())
        assert len(ranks) >= 2, watched.seen  # the watch saw the ranks: it could see one left
        _assert_exit(watched, outcome, "distributed training failed: torchrun exited", took)
        assert watched.left() == []


@pytest.mark.e2e
@pytest.mark.parametrize("outcome", OUTCOMES)
def test_local_sweep_in_two_lanes_leaves_no_process(outcome: str, tmp_path: Path) -> None:
    """Each lane's experiment in a spawned process. The error: one experiment diverges while the
    other trains; an interrupted or failed sweep used to go on to run every queued experiment."""
    sweep: dict[str, Any] = {"batch_sizes": [16, 32], "seeds": [0], "parallel": 2, "epochs": 3}
    train: dict[str, Any] = {}
    if outcome == "error":
        sweep.update(batch_sizes=[16], lr_multipliers=[1, 1e6], epochs=2000)
        train = {"optimizer": "sgd", "schedule": "constant", "lr": 0.01}
    elif outcome != "success":
        sweep.update(batch_sizes=[16, 32, 64, 128], epochs=2000)
    _prepared(tmp_path, sweep=sweep, train=train)
    with started(["batchlab", "sweep"], tmp_path, env_with_venv()) as watched:
        took = _ends(watched, outcome, lambda: _checkpoints(tmp_path, 2), "two experiments training")
        spawned = [cmd for _, cmd in watched.seen.values() if "multiprocessing.spawn" in cmd]
        assert len(spawned) >= 2, watched.seen
        _assert_exit(watched, outcome, "non-finite gradients", took)
        assert watched.left() == []
    if outcome in ("ctrl-c", "sigterm"):  # the queued experiments never started
        assert not (tmp_path / "sweep" / "experiments" / "bs64-seed0").exists()
        assert not (tmp_path / "sweep" / "experiments" / "bs128-seed0").exists()


@pytest.mark.e2e
@pytest.mark.parametrize("outcome", ["ctrl-c", "sigterm"])
def test_local_sweep_in_one_lane_stops_when_interrupted(outcome: str, tmp_path: Path) -> None:
    """One lane trains in the sweep's own process: the interruption reaches the training, where a
    pool thread it used to run in trained on, and then every other experiment, before the exit."""
    _prepared(tmp_path, sweep={"batch_sizes": [16, 32], "seeds": [0], "epochs": 2000})
    with started(["batchlab", "sweep"], tmp_path, env_with_venv()) as watched:
        took = _ends(watched, outcome, lambda: _checkpoints(tmp_path, 1), "the first experiment training")
        _assert_exit(watched, outcome, "", took)
        assert watched.left() == []
    assert len(list(tmp_path.glob("sweep/experiments/*"))) == 1


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, dict[str, str]]]:
    """A `prefect server`, a `dask scheduler` and one worker: the Dask sweeps' cluster, and their env."""
    folder = tmp_path_factory.mktemp("dask-leaks")
    with prefect_server(folder) as api:
        env = env_with_venv(PREFECT_API_URL=api)
        running = Cluster(folder, env)
        try:
            running.scheduler()
            running.worker("solo")
            yield running, env
        finally:
            running.stop()


@pytest.mark.e2e
@pytest.mark.parametrize("outcome", OUTCOMES)
def test_dask_sweep_leaves_no_process(outcome: str, cluster: tuple[Cluster, dict[str, str]], tmp_path: Path) -> None:
    """On its own machine: the sweep starts no Prefect server of its own and no local cluster."""
    dask, env = cluster
    sweep = {"batch_sizes": [16, 32], "seeds": [0], "executor": "dask", "dask_address": dask.address, "epochs": 3}
    train = DIVERGES if outcome == "error" else {}
    if outcome in ("ctrl-c", "sigterm"):
        sweep["epochs"] = 2000
    _prepared(tmp_path, sweep=sweep, train=train)
    with started(["batchlab", "sweep"], tmp_path, env) as watched:
        took = _ends(watched, outcome, lambda: _checkpoints(tmp_path, 1), "an experiment training on the worker")
        _assert_exit(watched, outcome, "non-finite gradients", took)
        assert watched.left() == [], watched.left()
    if outcome in ("ctrl-c", "sigterm"):
        # nor on the cluster: Dask runs a task to its end, unless the sweep stops it (sweep/stop.py)
        from distributed import Client

        with Client(dask.address, timeout=10, set_as_default=False) as client:
            wait_until(lambda: not any(client.processing().values()), "the worker to run nothing", timeout=30)
        (checkpoint,) = tmp_path.glob("sweep/experiments/*/.batchlab/checkpoints/train.pt")
        time.sleep(1)  # an epoch's checkpoint being written as the task was told
        before = checkpoint.stat().st_mtime_ns
        time.sleep(2)  # a few epochs, were it training
        assert checkpoint.stat().st_mtime_ns == before
        assert "Interrupted" in dask.log("solo")  # how the worker's task ended


@pytest.mark.e2e
def test_a_stopped_local_sweep_stops_its_lanes_processes_and_no_other_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lanes' stop signals the processes the lanes started (threads.in_fresh_process's), not
    every child of the sweep's process: one started before the lanes (a caller's, a library's)
    lives on. Real spawned processes; the lane's wait is a pool thread's, as in the sweep."""
    import multiprocessing
    from concurrent.futures import ThreadPoolExecutor

    from batchlab.sweep import executors

    context = multiprocessing.get_context("spawn")
    other = context.Process(target=time.sleep, args=(120,))
    other.start()
    try:
        others = set(multiprocessing.active_children())
        lane = context.Process(target=time.sleep, args=(120,))
        pool = ThreadPoolExecutor(max_workers=1)
        future = pool.submit(lambda: (lane.start(), lane.join()))
        # started and exec'd: a SIGINT that lands between spawn's fork and its exec is lost (the
        # child still has the parent's handler, which exec resets), and the stop then waits STOP_S
        # to kill it (seen once at load 6)
        wait_until(lambda: lane.pid and b"spawn_main" in _cmdline(lane.pid), "the lane's process to start", timeout=60)
        monkeypatch.setattr(executors, "ON_THEIR_OWN_S", 0.5)
        executors._stop(pool, [future], others)
        pool.shutdown(wait=True)  # as run_local's `finally` does after a stop
        assert future.done() and lane.exitcode is not None and other.is_alive()
    finally:
        other.kill()
        other.join(10)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone already
        return b""
