"""What the launcher hands torchrun: arguments and the ranks' environment."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from batchlab.config import TrainConfig, parse_config
from batchlab.data import Shape
from batchlab.training import launch, threads
from tests.support import tiny_config


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
    assert cmd[:3] == [sys.executable, "-m", "batchlab.training.loopback"]
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


def _machine(monkeypatch: pytest.MonkeyPatch, cores: int, busy: float = 0.0) -> None:
    """A process allowed on `cores` CPUs, with `busy` of them kept busy by other processes."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.delenv(threads.CORES_ENV, raising=False)
    monkeypatch.setattr(threads, "busy_cores", lambda window_s=0.1: busy)


def test_worker_env_shares_cores_between_ranks_and_passes_the_run_id(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, 8)
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


def test_usable_cores_are_this_process_affinity_not_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    _machine(monkeypatch, 2)
    assert threads.usable_cores() == 2
    assert [threads.threads_per_process(n) for n in (1, 2, 4)] == [2, 1, 1]


def test_a_granted_share_caps_this_process_and_the_ranks_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, 8)
    threads.limit_cores(3)  # a parallel sweep's experiment
    assert threads.usable_cores() == 3
    env = launch.worker_env(_train(nproc=2), run_id=None)
    assert env["OMP_NUM_THREADS"] == "1" and env[threads.CORES_ENV] == "3"


DATA = Shape(n_features=10, n_classes=2, rows={"train": 2800, "val": 600, "test": 600})  # params.yaml's


def _no_measuring(window_s: float = 0.1) -> float:
    raise AssertionError("measured the load although one thread was the answer")


def test_auto_gives_the_default_model_one_thread_without_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, 16)
    monkeypatch.setattr(threads, "busy_cores", _no_measuring)
    cfg = parse_config({})  # params.yaml's defaults: 64-wide, batch 64; the sweep up to batch 512
    assert threads.training_threads(cfg, DATA) == 1
    assert threads.sweep_threads(cfg, DATA) == 1


WIDE = {"model": {"hidden_sizes": [1024, 1024]}, "train": {"threads": 0, "batch_size": 512}}


@pytest.mark.parametrize(
    ("cores", "busy", "expected"),
    [(8, 0.0, 8), (8, 0.1, 8), (8, 2.9, 5), (2, 0.0, 2), (2, 1.0, 1), (2, 2.0, 1), (1, 0.0, 1)],
)
def test_auto_gives_a_wide_model_the_cores_no_other_process_is_busy_on(
    cores: int, busy: float, expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _machine(monkeypatch, cores, busy)
    assert threads.training_threads(tiny_config(**WIDE), DATA) == expected


def test_auto_stays_within_a_granted_share_while_the_other_shares_are_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, 8, busy=4.0)  # the sweep's other experiment, on its 4 cores
    threads.limit_cores(4)
    assert threads.training_threads(tiny_config(**WIDE), DATA) == 4


def test_auto_sizes_threads_to_the_micro_batch_a_process_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, 16)
    whole = tiny_config(model={"hidden_sizes": [256, 256]}, train={"threads": 0, "batch_size": 512})
    split = tiny_config(
        model={"hidden_sizes": [256, 256]}, train={"threads": 0, "batch_size": 512, "grad_accum_steps": 8}
    )
    assert threads.training_threads(whole, DATA) > threads.training_threads(split, DATA) > 1


def test_explicit_threads_are_used_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, 2, busy=2.0)
    monkeypatch.setattr(threads, "busy_cores", _no_measuring)
    cfg = tiny_config(model=WIDE["model"], train={"threads": 3})
    assert threads.training_threads(cfg, DATA) == threads.sweep_threads(cfg, DATA) == 3
    assert threads.inference_threads(cfg, DATA) == 3


def test_evaluate_and_export_size_threads_to_a_forward_pass_over_the_test_split(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _machine(monkeypatch, 8)
    cfg = tiny_config(model=WIDE["model"], train={"threads": 0})
    assert threads.inference_threads(cfg, DATA) == 8  # 600 rows through a 1024-wide model
    small = Shape(n_features=10, n_classes=2, rows={"train": 20, "val": 4, "test": 4})
    assert threads.inference_threads(cfg, small) == 1
    assert launch.stage_threads("evaluate", cfg, small) == launch.stage_threads("export", cfg, small) == 1


def test_processes_that_run_no_model_themselves_leave_threads_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, 8)
    assert launch.stage_threads("train", tiny_config(train={"strategy": "ddp", "threads": 0}), DATA) is None
    assert launch.stage_threads("sweep", tiny_config(train={"threads": 0}, sweep={"parallel": 2}), DATA) is None
    assert launch.stage_threads("sweep", tiny_config(train={"threads": 0}, sweep={"parallel": 1}), DATA) == 1


@pytest.mark.integration
def test_busy_cores_sees_a_process_spinning_on_a_core() -> None:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert threads.busy_cores(window_s=0.5) >= 0.5
    finally:
        spinner.kill()
        spinner.wait()


# a process with no threads of its own busy: busy_cores over the window each line on stdin names
SIBLING = """
import sys
from batchlab.training import threads
print("ready", flush=True)
for line in sys.stdin:
    print(threads.busy_cores(window_s=float(line)), flush=True)
"""


@pytest.mark.integration
def test_busy_cores_leaves_out_this_processs_own_threads() -> None:
    """A thread of this process spinning on a core is not a competitor: auto would give up a thread
    for it. A sibling process measures over the same window as this one, so both see the same load
    of every other process: the sibling counts the spinner as a busy core, this process must not,
    so its reading is lower by about the CPU this process used meanwhile (counted, they would read
    the same). In each round the gap must be over half of that; the median round decides, so a
    reading the two windows' small misalignment spoils cannot fail it."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    me = psutil.Process()
    spinner = threading.Thread(target=spin, daemon=True)
    sibling = subprocess.Popen([sys.executable, "-c", SIBLING], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)  # fmt: skip
    assert sibling.stdin is not None and sibling.stdout is not None
    rounds: list[tuple[float, float, float]] = []  # the sibling's reading, this process's, the CPU it used
    try:
        assert sibling.stdout.readline() == "ready\n"
        spinner.start()
        for _ in range(5):
            sibling.stdin.write("0.4\n")
            sibling.stdin.flush()
            before, started = sum(me.cpu_times()[:2]), time.perf_counter()
            mine = threads.busy_cores(window_s=0.4)
            used = (sum(me.cpu_times()[:2]) - before) / (time.perf_counter() - started)
            rounds.append((float(sibling.stdout.readline()), mine, used))
    finally:
        stop.set()
        if spinner.is_alive():
            spinner.join()
        sibling.kill()
        sibling.wait()
    margins = sorted(theirs - mine - used / 2 for theirs, mine, used in rounds)
    assert margins[len(margins) // 2] > 0, rounds
