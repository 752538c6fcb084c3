"""Where training processes start: torchrun for DDP and FSDP (so no stage needs a special command),
and which threads policy (threads.py) each stage's process applies."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from batchlab.config import Config, TrainConfig
from batchlab.training import threads

if TYPE_CHECKING:
    from batchlab.data import Shape

log = logging.getLogger(__name__)

RUN_ID_ENV = "BATCHLAB_RUN_ID"


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
            "--master-addr", host, "--master-port", port]


def stage_threads(stage: str, cfg: Config, shape: Shape) -> int | None:
    """The torch threads of a `batchlab <stage>` process, decided where it starts; None where it
    runs no model itself (a DDP launcher: its ranks get theirs; a parallel sweep: each experiment)."""
    if stage == "train":
        return None if uses_torchrun(cfg.train) else threads.training_threads(cfg, shape)
    if stage == "sweep":
        return threads.sweep_threads(cfg, shape) if cfg.sweep.parallel == 1 else None
    return threads.inference_threads(cfg, shape)  # evaluate, export


def apply_stage_threads(stage: str, cfg: Config, data_dir: Path) -> None:
    """Decide this process's torch threads for `stage` (train, evaluate, export or sweep), once,
    where it starts: `batchlab <stage>` and the Prefect flows both call it. A torchrun rank's
    were set by its launcher."""
    if is_worker():
        return
    from batchlab import data  # the prepared data's shape: numpy only, no torch

    count = stage_threads(stage, cfg, data.shape(data_dir))
    if count is not None:
        threads.use_threads(count)


def worker_env(cfg: TrainConfig, run_id: str | None) -> dict[str, str]:
    from batchlab.training import loopback

    env = dict(os.environ)
    # processes fight over cores unless each is told its share
    env["OMP_NUM_THREADS"] = str(cfg.threads or threads.threads_per_process(cfg.nproc))
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
    """Run `batchlab <stage_args>` on every rank of this machine, in `cwd`; raise LaunchError on failure.
    torchrun gets a session of its own, so a terminal's Ctrl-C reaches this process only, which tells
    torchrun once (a second signal cuts its shutdown of the ranks short)."""
    cmd = launch_command(cfg, stage_args)
    proc = subprocess.Popen(cmd, env=worker_env(cfg, run_id), cwd=cwd, start_new_session=True)
    try:
        while (code := _waited(proc)) is None:
            pass
    except BaseException:  # Ctrl-C, SIGTERM, an interrupted Dask sweep's stop (sweep/stop.py)
        _stop(proc)
        raise
    if code != 0:
        raise LaunchError(f"distributed training failed: torchrun exited {code} (the failing rank's error is above)")


def _waited(proc: subprocess.Popen[bytes]) -> int | None:
    """Its exit status, or None after a second: a wait in Python, not one blocking system call, so an
    exception raised in this thread from another (sweep/stop.py) gets in."""
    try:
        return proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        return None


# torchrun gives its ranks 30 s to end after it is told to stop, then kills them
STOP_S = 60


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Tell torchrun to stop its ranks, and wait until it has. Its ranks run in sessions of their
    own: subprocess.run's SIGKILL of torchrun on Ctrl-C left them training, with no parent."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
