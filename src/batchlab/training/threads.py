"""The thread policy: how many cores a process may use, and how many torch threads it runs.
`use_threads` is the one place that sets torch's thread count; `in_fresh_process` the one place
that starts a spawned process with its share of the cores."""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import TYPE_CHECKING, TypeVar

from batchlab.config import Config, ModelConfig

if TYPE_CHECKING:
    from batchlab.data import Shape

log = logging.getLogger(__name__)
T = TypeVar("T")

# the cores a parent process granted this one (a parallel sweep's experiment); its children inherit it
CORES_ENV = "BATCHLAB_CORES"
# A training step of this MLP on 2 threads vs 1, on a 2-core machine with its cores free (fastest of
# 6 x 20 steps, widths 64-1024 x batches 16-2048): below 15 MFLOP per step 0.93-1.04x (the 64-wide
# default at batch 64 is 1.9 MFLOP), 26-60 MFLOP 1.07-1.14x, 100-800 MFLOP 1.14-1.38x, from 1.6 GFLOP
# ~1.5x; beside one busy process 0.05-0.8x at every size (benchmarks/bench_threads.py measures the
# same). Hence a second thread from 25 MFLOP; more threads per FLOP on bigger machines is assumed.
FLOPS_PER_THREAD = 12.5e6


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


_FORWARD_FLOPS: dict[str, float] = {}


def model_step_flops(cfg: ModelConfig, shape: Shape, rows: int) -> float:
    """A training step's floating-point operations on `rows` examples: the MLP's from its widths;
    any other model's counted by torch.utils.flop_counter on one example's forward (x3 for the
    backward), once per model and shape."""
    if cfg.is_mlp():
        return step_flops(cfg, shape.n_features, shape.n_classes, rows)
    key = f"{cfg.model_dump_json()}-{shape.input_shape}-{shape.n_classes}-{shape.vocab}"
    if key not in _FORWARD_FLOPS:
        import torch
        from torch.utils.flop_counter import FlopCounterMode

        from batchlab.model import build_model

        model = build_model(cfg, shape.input_shape, shape.n_classes, shape.vocab).eval()
        example = torch.zeros(1, *shape.input_shape)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(example)
        _FORWARD_FLOPS[key] = float(counter.get_total_flops())
    return 3.0 * rows * _FORWARD_FLOPS[key]


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
    return auto_threads(model_step_flops(cfg.model, shape, rows))


def sweep_threads(cfg: Config, shape: Shape) -> int:
    """One thread count for every experiment of a sweep, so their samples/s compare: that of its
    largest batch (a second thread costs small batches a few percent at most)."""
    return training_threads(cfg, shape, batch=max(cfg.sweep.batch_sizes))


def inference_threads(cfg: Config, shape: Shape) -> int:
    """train.threads when set; otherwise chosen from the work of one forward pass over the test
    split (a third of a training step's), the largest that evaluate and export run."""
    if cfg.train.threads:
        return cfg.train.threads
    return auto_threads(model_step_flops(cfg.model, shape, shape.rows["test"]) / 3)


def use_threads(threads: int) -> None:
    """Run this process's torch operations on `threads` threads."""
    import torch

    torch.set_num_threads(threads)
    log.debug("torch threads: %d", threads)  # the run tags and train_summary.json record it


@contextlib.contextmanager
def on_threads(threads: int) -> Iterator[None]:
    """This process's torch operations on `threads` threads for the block, then as they were."""
    import torch

    before = torch.get_num_threads()
    use_threads(threads)
    try:
        yield
    finally:
        use_threads(before)


def _run_with_cores(cores: int, fn: Callable[..., T], *args: object) -> T:
    limit_cores(cores)  # this process, and ranks it starts, use its share of the cores
    return fn(*args)


def in_fresh_process(cores: int, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in a fresh (spawned) process allowed `cores` cores; its result back here. Spawn:
    torch and fork do not mix, and a fresh process gives an honest peak-memory figure."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(_run_with_cores, cores, fn, *args).result()
