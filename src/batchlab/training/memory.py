"""Tensor memory of one training step, and the largest batch a memory budget allows.

Process RSS (what `Strategy.peak_memory_mb` reports on CPU) is mostly the torch runtime and barely
moves with the batch; these figures count only the step's own tensors.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from batchlab.config import Config
from batchlab.training.gns import NoiseScale
from batchlab.training.gns_probes import FULL_SPLIT_CHUNK
from batchlab.training.optim import make_optimizer
from batchlab.training.strategy import Strategy
from batchlab.training.train import initial_model

MIB = 2**20
_MEASURED = "batchlab.training.memory.measured_step"
_PROBING = "batchlab.training.memory.probing_step"
PROBING_STEP = 3  # warm-up (1), the step the probe skips (2), the step it measures (3)


Shape = int | tuple[int, ...]  # one example's: an int is rows of that many features


def step_memory_mib(
    cfg: Config, input_shape: Shape, n_classes: int, batch_size: int, device: torch.device, probing: bool = False
) -> float:
    """Peak tensor memory of one training step of `batch_size` rows, in MiB (see `step_memories`);
    `probing`: of a step on which the noise probe measures."""
    plain, with_probe = step_memories(cfg, input_shape, n_classes, batch_size, device)
    return with_probe if probing else plain


def examples(input_shape: Shape, rows: int, gen: torch.Generator, vocab: int = 0) -> torch.Tensor:
    """Seeded random examples of the right shape: token ids below `vocab` (as float32), else normal values."""
    shape = (input_shape,) if isinstance(input_shape, int) else tuple(input_shape)
    if vocab:
        return torch.randint(vocab, (rows, *shape), generator=gen).float()
    return torch.randn(rows, *shape, generator=gen)


def step_memories(
    cfg: Config, input_shape: Shape, n_classes: int, batch_size: int, device: torch.device, vocab: int = 0
) -> tuple[float, float]:
    """Peak tensor memory, in MiB, of a training step of `batch_size` rows (parameters, gradients,
    optimizer state, the step's copy of its rows and the activations; not the dataset, not the
    runtime's own memory), and of a step on which the noise probe measures (its passes over the
    train split, a chunk of rows at a time): the largest step training takes when train.gns is on.

    The step is train.py's (its rows copied from the resident train split, cross-entropy,
    train.precision, train.grad_accum_steps) in one process: under DDP a rank holds batch_size /
    world_size rows, so pass that. A warm-up step creates the optimizer state; the second step
    (the probe skips it) and the third (the probe measures) are measured, in one profiling session.
    The rows are seeded random values of the right shape.
    """
    gen = torch.Generator().manual_seed(cfg.train.seed)
    # the train split, resident before training starts (as in fit): not the step's memory
    x = examples(input_shape, batch_size, gen, vocab).to(device)
    y = torch.randint(n_classes, (batch_size,), generator=gen).to(device)
    # the rows the noise probe passes over, a chunk at a time: its peak is one chunk's, however many
    split = (examples(input_shape, FULL_SPLIT_CHUNK, gen, vocab).to(device),
             torch.randint(n_classes, (FULL_SPLIT_CHUNK,), generator=gen).to(device))
    peaks = (_cuda_peaks if device.type == "cuda" else _cpu_peaks)(cfg, x, y, n_classes, split, vocab)
    return peaks[0] / MIB, peaks[1] / MIB


Rows = tuple[torch.Tensor, torch.Tensor]


def _trainer(
    cfg: Config, x: torch.Tensor, y: torch.Tensor, n_classes: int, split: Rows, vocab: int = 0
) -> Callable[[], None]:
    """The model and optimizer on x's device, and a function that runs one training step over x's
    rows; the noise probe measures on every PROBING_STEP-th call."""
    device = x.device
    strategy = Strategy(device, cfg.train.precision, grad_accum_steps=cfg.train.grad_accum_steps)
    model = initial_model(cfg, tuple(x.shape[1:]), n_classes, vocab).to(device)
    optimizer = make_optimizer(cfg.train, model.parameters())
    noise = NoiseScale(enabled=True, population=10 * x.shape[0])  # N: only the estimate uses it
    # a period given measures the weights after each multiple of it, i.e. on call period + 1
    net = strategy.setup(model, noise, F.cross_entropy, probe_every=PROBING_STEP - 1, train_rows=split)
    net.train()
    rows = torch.arange(x.shape[0], device=device)

    def step() -> None:  # the body of train.fit's step loop
        for part in strategy.micro_batches(net, rows):
            inputs, targets = x[part], y[part]
            with strategy.autocast():
                loss = F.cross_entropy(net(inputs), targets)
            strategy.backward(loss, inputs, targets)
        strategy.step(optimizer)

    return step


def _cpu_peaks(
    cfg: Config, x: torch.Tensor, y: torch.Tensor, n_classes: int, split: Rows, vocab: int = 0
) -> tuple[int, int]:
    """Peaks of the live bytes allocated since profiling began, during the two measured steps.

    Each "[memory]" event carries the signed bytes of one allocation or free; their running sum is
    the live total. The model and optimizer are built inside the profiler, so nothing of the step
    was allocated before it. Not the trace's "Total Allocated": a process-wide counter that
    keeps the bytes of earlier profiling sessions that were freed while no profiler was running.
    """
    gc.collect()  # a leftover from an earlier session freed mid-profile would subtract bytes never added
    with _native_stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step = _trainer(cfg, x, y, n_classes, split, vocab)
        step()
        with record_function(_MEASURED):
            step()
        with record_function(_PROBING):
            step()
    # the raw events: prof.events() folds each allocation into the op that made it, losing the order
    assert prof.profiler is not None and prof.profiler.kineto_results is not None
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    windows = [next(e for e in events if e.name() == name) for name in (_MEASURED, _PROBING)]
    live, peaks = 0, [0, 0]
    for event in events:
        if event.name() != "[memory]":
            continue
        live += event.nbytes()
        for k, window in enumerate(windows):
            if window.start_ns() <= event.start_ns() <= window.end_ns():
                peaks[k] = max(peaks[k], live)
    return peaks[0], peaks[1]


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Kineto prints "USDT: ... profiler_start/stop" lines from C++ on every profile, whatever
    KINETO_LOG_LEVEL says: point the process's fd 2 elsewhere for the fraction of a second it runs."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _cuda_peaks(
    cfg: Config, x: torch.Tensor, y: torch.Tensor, n_classes: int, split: Rows, vocab: int = 0
) -> tuple[int, int]:
    device = x.device
    before = torch.cuda.memory_allocated(device)  # other tensors of this process: not the step's
    step = _trainer(cfg, x, y, n_classes, split, vocab)
    step()
    peaks = []
    for _ in range(2):  # the step the probe skips, then the one it measures
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        peaks.append(torch.cuda.max_memory_allocated(device) - before)
    return peaks[0], peaks[1]
