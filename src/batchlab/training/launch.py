"""Where training processes start: torchrun for DDP and FSDP (so no stage needs a special command), and how
many threads each process runs."""

from __future__ import annotations

import itertools
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from batchlab.config import Config, ModelConfig, TrainConfig

if TYPE_CHECKING:
    from batchlab.data import Shape

log = logging.getLogger(__name__)

RUN_ID_ENV = "BATCHLAB_RUN_ID"
# the cores a parent process granted this one (a parallel sweep's experiment); its children inherit it
CORES_ENV = "BATCHLAB_CORES"
# A training step of this MLP on 2 threads vs 1, on a 2-core machine with its cores free (fastest of
# 6 x 20 steps, widths 64-1024 x batches 16-2048): below 15 MFLOP per step 0.93-1.04x (the 64-wide
# default at batch 64 is 1.9 MFLOP), 26-60 MFLOP 1.07-1.14x, 100-800 MFLOP 1.14-1.38x, from 1.6 GFLOP
# ~1.5x; beside one busy process 0.05-0.8x at every size (benchmarks/bench_threads.py measures the
# same). Hence a second thread from 25 MFLOP; more threads per FLOP on bigger machines is assumed.
FLOPS_PER_THREAD = 12.5e6


class LaunchError(RuntimeError):
    """The launcher exited non-zero: a rank failed and restarts (if any) were used up."""


def is_worker() -> bool:
    """True inside a process that torchrun started."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def torchrun_args(cfg: TrainConfig) -> list[str]:
    args = ["--nproc-per-node", str(cfg.nproc), "--max-restarts", str(cfg.max_restarts)]
    if cfg.nnodes == 1:
        # a free local port for the rendezvous, so parallel sweeps never collide
        return [*args, "--standalone"]
    # other machines must reach this one: the stores listen on every interface
    host, _, port = cfg.rdzv_endpoint.rpartition(":")
    # static rendezvous: node_rank 0 hosts global rank 0, which writes every output
    return [*args, "--nnodes", str(cfg.nnodes), "--node-rank", str(cfg.node_rank),
            "--master-addr", host, "--master-port", port]  # fmt: skip


def _affinity() -> list[int]:
    """The CPUs this process may run on (taskset, a cgroup cpuset), not the machine's count."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (macOS, Windows)
        return list(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity, within what a parent granted it (CORES_ENV)."""
    cores = len(_affinity())
    granted = os.environ.get(CORES_ENV, "")
    return max(1, min(cores, int(granted))) if granted.isdigit() and int(granted) > 0 else cores


def limit_cores(cores: int) -> None:
    """Let this process, and the processes it starts, use at most `cores` cores."""
    os.environ[CORES_ENV] = str(cores)


def threads_per_process(processes: int) -> int:
    """This process's share of the usable cores when `processes` processes run at once: more
    threads than cores only spin."""
    return max(1, usable_cores() // processes)


def busy_cores(window_s: float = 0.1) -> float:
    """How many of this process's CPUs other processes keep busy, measured over `window_s` while
    this one's main thread sleeps. This process's own threads do not count: right after its imports
    a library's worker thread here was still busy for a moment (0.4-0.67 of a core in the window),
    which made auto pick 1 thread for a model where 2 ran 1.5x faster."""
    import psutil

    me = psutil.Process()
    before, started = sum(me.cpu_times()[:2]), time.perf_counter()
    percent = psutil.cpu_percent(interval=window_s, percpu=True)
    own = (sum(me.cpu_times()[:2]) - before) / (time.perf_counter() - started)
    return max(0.0, sum(percent[i] for i in _affinity() if i < len(percent)) / 100 - own)


def step_flops(model: ModelConfig, n_features: int, n_classes: int, rows: int) -> float:
    """Floating-point operations of one training step of the MLP on `rows` rows (backward ~ 2x forward)."""
    widths = [n_features, *model.hidden_sizes, n_classes]
    return 6.0 * rows * sum(a * b for a, b in itertools.pairwise(widths))


def auto_threads(flops: float) -> int:
    """Threads for training steps of `flops` each: one per FLOPS_PER_THREAD, within this process's
    cores, and only on CPUs no other process is using (measured for 0.1 s when more than one thread
    would be used)."""
    threads = min(usable_cores(), max(1, int(flops // FLOPS_PER_THREAD)))
    if threads > 1:
        # a CPU counts as taken from a quarter busy: another runnable thread on it stalls a thread
        # team at every join. Counted over every CPU of the affinity, so the experiments of a
        # parallel sweep, each within its share, do not count each other twice.
        free = len(_affinity()) - math.ceil(busy_cores() - 0.25)
        threads = max(1, min(threads, free))
    return threads


def training_threads(cfg: Config, shape: Shape, batch: int | None = None) -> int:
    """train.threads when set; otherwise (0, auto) chosen from the work of a step at `batch`
    (default train.batch_size) within this process's cores."""
    tc = cfg.train
    if tc.threads:
        return tc.threads
    rows = max(1, (batch or tc.batch_size) // (tc.world_size() * tc.grad_accum_steps))
    return auto_threads(step_flops(cfg.model, shape.n_features, shape.n_classes, rows))


def sweep_threads(cfg: Config, shape: Shape) -> int:
    """One thread count for every experiment of a sweep, so their samples/s compare: that of its
    largest batch (a second thread costs small batches a few percent at most)."""
    return training_threads(cfg, shape, batch=max(cfg.sweep.batch_sizes))


def inference_threads(cfg: Config, shape: Shape) -> int:
    """train.threads when set; otherwise chosen from the work of one forward pass over the test
    split (a third of a training step's), the largest that evaluate and export run."""
    if cfg.train.threads:
        return cfg.train.threads
    return auto_threads(step_flops(cfg.model, shape.n_features, shape.n_classes, shape.rows["test"]) / 3)


def stage_threads(stage: str, cfg: Config, shape: Shape) -> int | None:
    """The torch threads of a `batchlab <stage>` process, decided where it starts; None where it
    runs no model itself (a DDP launcher: its ranks get theirs; a parallel sweep: each experiment)."""
    if stage == "train":
        return None if uses_torchrun(cfg.train) else training_threads(cfg, shape)
    if stage == "sweep":
        return sweep_threads(cfg, shape) if cfg.sweep.parallel == 1 else None
    return inference_threads(cfg, shape)  # evaluate, export


def apply_stage_threads(stage: str, cfg: Config, data_dir: Path) -> None:
    """Decide this process's torch threads for `stage` (train, evaluate, export or sweep), once,
    where it starts: `batchlab <stage>` and the Prefect flows both call it. A torchrun rank's
    were set by its launcher."""
    if is_worker():
        return
    from batchlab import data  # the prepared data's shape: numpy only, no torch

    threads = stage_threads(stage, cfg, data.shape(data_dir))
    if threads is not None:
        use_threads(threads)


def use_threads(threads: int) -> None:
    """Run this process's torch operations on `threads` threads."""
    import torch

    torch.set_num_threads(threads)
    log.debug("torch threads: %d", threads)  # the run tags and train_summary.json record it


def worker_env(cfg: TrainConfig, run_id: str | None) -> dict[str, str]:
    from batchlab.training import loopback

    env = dict(os.environ)
    # processes fight over cores unless each is told its share
    threads = cfg.threads or threads_per_process(cfg.nproc)
    env["OMP_NUM_THREADS"] = str(threads)
    # torch 2.13 reuses the agent's TCPStore across restart rounds, and restarted gloo ranks
    # then read the dead ranks' addresses ("connectFullMesh ... Connection refused")
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if run_id:
        env[RUN_ID_ENV] = run_id
    else:
        env.pop(RUN_ID_ENV, None)
    if cfg.nnodes == 1:
        # one machine: the ranks' store and gloo's sockets listen on loopback, not on every interface
        env[loopback.LOOPBACK_ENV] = "1"
        env["GLOO_SOCKET_IFNAME"] = loopback.loopback_interface()
    else:
        env.pop(loopback.LOOPBACK_ENV, None)
    return env


def launch_command(cfg: TrainConfig, stage_args: list[str]) -> list[str]:
    """torchrun running `batchlab <stage_args>`; on one machine, the variant whose stores listen on loopback."""
    launcher = "batchlab.training.loopback" if cfg.nnodes == 1 else "torch.distributed.run"
    return [sys.executable, "-m", launcher, *torchrun_args(cfg), "-m", "batchlab.cli", *stage_args]


def uses_torchrun(cfg: TrainConfig) -> bool:
    """Whether training starts ranks through torchrun, or runs in the calling process."""
    return cfg.strategy != "single"


def launch(cfg: TrainConfig, stage_args: list[str], cwd: Path, run_id: str | None) -> None:
    """Run `batchlab <stage_args>` on every rank of this machine, in `cwd`; raise LaunchError on failure."""
    code = subprocess.run(launch_command(cfg, stage_args), env=worker_env(cfg, run_id), cwd=cwd).returncode
    if code != 0:
        raise LaunchError(f"distributed training failed: torchrun exited {code} (the failing rank's error is above)")
