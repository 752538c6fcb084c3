"""Faults together, during one Dask sweep: a seeded schedule of them, applied to real processes.

A schedule is drawn from its seed alone, so a failure replays: the faults (each kind once, a
worker killed twice), their order, which worker each one hits and the pauses between them. The
kinds:

    kill-worker      a worker SIGKILLed, started again 0.5-3 s later (its task reruns elsewhere)
    freeze-worker    a worker SIGSTOPped until the scheduler has given it up (its heartbeat missed)
                     and the other worker, running its task again, waits for the experiment's claim
                     (at most 20 s), then resumed: its own copy finishes and commits, the second copy
                     returns that result, and the worker closes, as one the scheduler removed does;
                     a new one takes its place
    restart-mlflow   the MLflow server killed and started again 0.5-3 s later
    restart-scheduler the scheduler killed: the sweep stops with one line, the workers close once
                     their running experiment has finished; a new cluster starts and the sweep reruns

The workers run without a nanny: with one, the nanny kills a resumed worker's process, and the
frozen copy never finishes. A schedule's faults start once the first experiment trains and fire
while the sweep (or its rerun) runs; the sweep is run again until it finishes.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import yaml

from tests.support import MlflowServer, merge, wait_until, write_params
from tests.support.dask import Cluster

KINDS = ("kill-worker", "kill-worker", "freeze-worker", "restart-mlflow", "restart-scheduler")
WORKERS = ("w1", "w2")
# the scheduler gives a silent worker up after this (Dask's default: 5 min); 2 s (5 s in effect: 10
# heartbeats) lost both live workers of a loaded machine to one 5.6 s stall of its event loop
SCHEDULER_ENV = {"DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL": "15s"}
WAIT_FOR_COPY_S = 20.0  # a frozen worker stays frozen at most this long for its task's second copy
ATTEMPTS = 4  # the sweep and its reruns: a scheduler restart ends one, a task killed too often another


@dataclass(frozen=True)
class Fault:
    kind: str
    worker: str  # the worker it hits (kill-worker, freeze-worker)
    pause_s: float  # before it fires, after the one before (or the first experiment's start)
    down_s: float  # how long the killed thing stays down (kill-worker, restart-mlflow)


def schedule(seed: int) -> list[Fault]:
    """The faults of schedule `seed`, in the order they fire."""
    rng = random.Random(seed)
    kinds = list(KINDS)
    rng.shuffle(kinds)
    return [Fault(k, rng.choice(WORKERS), round(rng.uniform(0.3, 2.0), 2), round(rng.uniform(0.5, 3.0), 2))
            for k in kinds]  # fmt: skip


SOAK = 20  # benchmarks/bench_chaos.py's schedules, 1..20


def commit_schedule() -> int:
    """The schedule CI runs for the commit under test: its number of commits modulo the soak's 20, so
    that successive commits step through every schedule (1 where git cannot say)."""
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(["git", "rev-list", "--count", "HEAD"], cwd=repo, capture_output=True, text=True)
    count = proc.stdout.strip()
    return int(count) % SOAK + 1 if proc.returncode == 0 and count.isdigit() else 1


def describe(seed: int) -> str:
    named = [f"{f.kind}{f' {f.worker}' if 'worker' in f.kind else ''} after {f.pause_s} s" for f in schedule(seed)]
    faults = ", ".join(named)
    return f"chaos schedule {seed}: {faults}; replay it with BATCHLAB_CHAOS_SEEDS={seed}"


@dataclass
class Chaos:
    """One sweep folder, its cluster and MLflow server, and what the faults have left to clean up."""

    folder: Path
    cluster: Cluster
    mlflow: MlflowServer
    env: dict[str, str]
    attempts: list[subprocess.Popen[bytes]] = field(default_factory=list)
    retired: list[subprocess.Popen[bytes]] = field(default_factory=list)  # processes that must end by themselves
    fired: list[str] = field(default_factory=list)

    # the cluster

    def up(self) -> None:
        """A scheduler and both workers running, the sweep's params pointing at the scheduler."""
        scheduler = self.cluster.procs.get("scheduler")
        if scheduler is None or scheduler.poll() is not None:
            self.cluster.scheduler(**SCHEDULER_ENV)
            params = yaml.safe_load((self.folder / "params.yaml").read_text())
            write_params(self.folder, merge(params, {"sweep": {"dask_address": self.cluster.address}}))
        for name in WORKERS:
            self.worker(name)

    def worker(self, name: str) -> None:
        """`name` running, a new process unless it runs already (one it replaces must have ended)."""
        proc = self.cluster.procs.get(name)
        if proc is not None and proc.poll() is None:
            return
        # the task's batchlab lines (a claim waited for) in the worker's log, through Prefect's handlers
        self.cluster.worker(name, nanny=False, PREFECT_LOGGING_EXTRA_LOGGERS="batchlab")

    # the sweep

    def start(self) -> subprocess.Popen[bytes]:
        n = len(self.attempts)
        with open(self.folder / f"sweep-{n}.out", "w") as out, open(self.folder / f"sweep-{n}.err", "w") as err:
            proc = subprocess.Popen(["batchlab", "sweep"], cwd=self.folder, env=self.env, stdout=out, stderr=err,
                                    start_new_session=True)  # fmt: skip
        self.attempts.append(proc)
        return proc

    def stderr(self) -> str:
        return "\n".join(
            f"--- attempt {n}:\n" + (self.folder / f"sweep-{n}.err").read_text(errors="replace")[-3000:]
            for n in range(len(self.attempts))
        )

    def training(self, proc: subprocess.Popen[bytes]) -> None:
        """Until the first experiment's checkpoint sidecar exists (it trains, its run open)."""
        started = lambda: any(self.folder.glob("sweep/experiments/*/.batchlab/checkpoints/train.pt.run"))  # noqa: E731
        wait_until(started, "the first experiment to train", interval=0.1, process=proc, log=proc_log(self, proc))

    # the faults

    def fire(self, fault: Fault, during_sweep: bool) -> None:
        getattr(self, fault.kind.replace("-", "_"))(fault)
        self.fired.append(fault.kind if during_sweep else f"{fault.kind} (after the sweep had finished)")

    def kill_worker(self, fault: Fault) -> None:
        self.cluster.kill(fault.worker)
        time.sleep(fault.down_s)
        self.worker(fault.worker)

    def freeze_worker(self, fault: Fault) -> None:
        proc = self.cluster.procs[fault.worker]
        given_up, waits = self.cluster.log("scheduler").count("Worker failed to heartbeat"), self.claim_waits()
        self.cluster.pause(fault.worker)
        try:
            wait_until(lambda: self.cluster.log("scheduler").count("Worker failed to heartbeat") > given_up,
                       f"the scheduler to give up frozen {fault.worker}", timeout=120)  # fmt: skip
            # frozen until the other worker runs its task again and waits for the experiment's claim
            # (the frozen one holds it); not when it held no task, or the other is still busy
            deadline = time.monotonic() + WAIT_FOR_COPY_S
            while self.claim_waits() == waits and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            self.cluster.resume(fault.worker)
        self.retired.append(proc)  # closes once its own copy has finished (Dask waits for the executor)
        wait_until(lambda: proc.poll() is not None, f"frozen {fault.worker} to finish and close", timeout=300)
        self.worker(fault.worker)

    def restart_mlflow(self, fault: Fault) -> None:
        self.mlflow.kill()
        time.sleep(fault.down_s)
        self.mlflow.start()

    def restart_scheduler(self, fault: Fault) -> None:
        workers = [self.cluster.procs[name] for name in WORKERS]
        self.cluster.kill("scheduler")
        self.retired.extend(workers)
        # a worker closes once its running experiment has finished; then the new cluster starts
        wait_until(lambda: all(w.poll() is not None for w in workers), "the workers to close", timeout=300)
        self.up()

    def claim_waits(self) -> int:
        """How often a task's copy has found its experiment claimed by another (the workers' logs)."""
        logs = [self.cluster.folder / f"{name}.log" for name in WORKERS]
        return sum(p.read_text(errors="replace").count("is claimed by another copy") for p in logs if p.exists())

    def left_behind(self) -> list[str]:
        """The processes of every sweep attempt's session, and every retired worker, still running."""
        alive = [f"{p.pid}: retired worker" for p in self.retired if p.poll() is None]
        sessions = {p.pid for p in self.attempts}
        for process in psutil.process_iter(["pid", "cmdline", "status"]):
            with contextlib.suppress(OSError, psutil.Error):
                if os.getsid(process.pid) in sessions and process.info["status"] != psutil.STATUS_ZOMBIE:
                    alive.append(f"{process.pid}: {' '.join(process.info['cmdline'] or [])}")
        return alive


def proc_log(chaos: Chaos, proc: subprocess.Popen[bytes]) -> Path:
    return chaos.folder / f"sweep-{chaos.attempts.index(proc)}.err"


def run_to_the_end(chaos: Chaos, proc: subprocess.Popen[bytes] | None = None, what: str = "the sweep") -> None:
    """The sweep (`proc`, else a new attempt) run again on a whole cluster until it finishes, at
    most ATTEMPTS attempts in all: the undisturbed reference, should the machine's load cost it its
    workers, and a schedule's sweep after its faults."""
    proc = proc or chaos.start()
    while proc.wait(timeout=600) != 0:
        if len(chaos.attempts) >= ATTEMPTS:
            raise AssertionError(f"{what}\nthe sweep did not finish in {ATTEMPTS} attempts\n{chaos.stderr()}")
        chaos.up()
        proc = chaos.start()


def run_schedule(chaos: Chaos, seed: int) -> None:
    """The sweep under schedule `seed`'s faults, run again until it finishes (at most ATTEMPTS);
    what happened is kept in the folder's chaos.json (the soak's table reads it)."""
    faults, started, waits = schedule(seed), time.monotonic(), chaos.claim_waits()
    try:
        _run(chaos, faults, seed)
    finally:
        record = {"seed": seed, "schedule": [f.kind for f in faults], "fired": chaos.fired,
                  "attempts": len(chaos.attempts), "seconds": round(time.monotonic() - started, 1),
                  "claim_waits": chaos.claim_waits() - waits}  # fmt: skip
        (chaos.folder / "chaos.json").write_text(json.dumps(record, indent=2) + "\n")


def _run(chaos: Chaos, faults: list[Fault], seed: int) -> None:
    proc = chaos.start()
    chaos.training(proc)
    for fault in faults:
        time.sleep(fault.pause_s)
        if proc.poll() not in (None, 0):  # it stopped (a scheduler restart, a task killed too often): again
            chaos.up()
            proc = chaos.start()
        chaos.fire(fault, during_sweep=proc.poll() is None)
    run_to_the_end(chaos, proc, describe(seed))


@contextlib.contextmanager
def resumed_on_failure(chaos: Chaos) -> Iterator[None]:
    """Whatever happens, no worker stays frozen and no sweep attempt keeps running."""
    try:
        yield
    finally:
        for name in WORKERS:
            with contextlib.suppress(KeyError, ProcessLookupError):
                chaos.cluster.resume(name)
        for proc in chaos.attempts:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
