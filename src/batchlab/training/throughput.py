"""The throughput table: every batch size's training speed, measured side by side in one block.

A speed measured once per batch size, when that batch size's experiments run, inverts under load:
in one study on a busy machine batch 16 read 234k samples/s and batch 128 96k, because the larger
batches were timed while the machine was busier (quiet: 49k and 251k). Here every batch size is
timed in the same block, round robin: each round times one short window of optimizer steps at each
batch size (the order rotated from round to round), so whatever load comes and goes falls on all of
them alike. Each entry is the median over ROUNDS rounds, with the order-statistic interval of that
median; the load average is recorded before and after. One more entry times the noise probe (two
passes over the train split and the rows' own gradients), which costs the same at every batch size.

The step timed is the loop's own (train.train_step): the same model, optimizer, precision and
device, on one process, without the noise probe and without scoring. `a + b·B` seconds per step,
fitted to the medians by least squares on relative error, is stored with the table: the seconds a
batch size the table did not time would take.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from batchlab import atomic, kept
from batchlab.config import Config, ConfigError
from batchlab.data import Dataset
from batchlab.training.gns_probes import FullSplitProbe
from batchlab.training.optim import make_optimizer
from batchlab.training.strategy import Strategy
from batchlab.training.support import resolve_device
from batchlab.training.train import initial_model, split_tensors, train_step

log = logging.getLogger(__name__)

ROUNDS = 9  # the median of 9 has a 96.1% order-statistic interval: the 2nd to the 8th value
INTERVAL_RANK = 2  # that interval's rank from each end (1-based)
WINDOW_SECONDS = 0.04  # a window's length, from the warm-up round's step time (at least MIN_STEPS steps)
MIN_STEPS = 3
PROBE = "probe"  # the noise probe's entry: seconds per measurement


@dataclass(frozen=True)
class Entry:
    """One batch size's steps (or the probe's measurements): seconds per step in each round."""

    batch_size: int  # 0 for the probe
    steps: int  # per window
    seconds: list[float]  # per step, one figure per round

    @property
    def median(self) -> float:
        return sorted(self.seconds)[len(self.seconds) // 2]

    @property
    def interval(self) -> tuple[float, float]:
        """The median's interval from the order statistics (9 rounds: 96.1%), in seconds per step;
        with fewer than 2·INTERVAL_RANK + 1 rounds the slowest and fastest."""
        ordered = sorted(self.seconds)
        k = INTERVAL_RANK - 1 if len(ordered) > 2 * INTERVAL_RANK else 0
        return ordered[k], ordered[-1 - k]


@dataclass(frozen=True)
class Table:
    """The table a study and the adaptive rule read their clock from (kept as JSON beside the sweep)."""

    key: str  # model, data shape, strategy, precision, device, threads, machine, code
    entries: list[Entry]
    probe: Entry | None  # None where the noise probe does not run (train.gns off, a model it cannot measure)
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    cores: int
    threads: int
    machine: str
    seconds: float  # the block's wall time
    fit: tuple[float, float] = field(default=(math.nan, math.nan))  # (a, b): a + b·B seconds per step

    def entry(self, batch: int) -> Entry | None:
        return next((e for e in self.entries if e.batch_size == batch), None)

    def step_seconds(self, batch: int) -> float:
        """Seconds per optimizer step at `batch`: the measured median, else the fit."""
        found = self.entry(batch)
        if found is not None:
            return found.median
        a, b = self.fit
        return a + b * batch

    def samples_per_s(self, batch: int) -> float:
        return batch / self.step_seconds(batch)

    @property
    def probe_seconds(self) -> float:
        return self.probe.median if self.probe is not None else 0.0

    def step_time(self) -> list[float]:
        """train.adapt_step_time: [a, b, p], the fit and the probe's seconds."""
        return [*self.fit, self.probe_seconds]

    def to_dict(self) -> dict[str, Any]:
        out = {"source": "table", **asdict(self)}  # what the study's seconds were read from (study/clock.py)
        out["rows"] = [self.row(e.batch_size) for e in self.entries]  # what a reader wants, derived
        out["probe_seconds"] = self.probe_seconds
        return out

    def row(self, batch: int) -> dict[str, float]:
        found = self.entry(batch)
        assert found is not None
        slow, fast = found.interval
        return {"batch_size": batch, "samples_per_s": self.samples_per_s(batch), "samples_per_s_low": batch / fast,
                "samples_per_s_high": batch / slow, "step_ms": 1e3 * found.median,
                "fit_step_ms": 1e3 * (self.fit[0] + self.fit[1] * batch)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Table:
        entries = [Entry(**e) for e in raw["entries"]]
        probe = Entry(**raw["probe"]) if raw.get("probe") else None
        load_before, load_after, fit = tuple(raw["load_before"]), tuple(raw["load_after"]), tuple(raw["fit"])
        return cls(raw["key"], entries, probe, load_before, load_after, raw["cores"], raw["threads"], raw["machine"],
                   raw["seconds"], fit)


def fit_step_time(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of t(B) = a + b·B through (B, seconds per step), least squares on relative error (each
    point weighted 1/t², so a small batch's 0.4 ms counts as much as a large one's 4 ms); a and b are
    kept at or above zero (a step's cost neither falls with its rows nor is negative with none)."""
    if len(points) < 2:
        ((batch, t),) = points
        return 0.0, t / batch
    w = [1 / t**2 for _, t in points]
    sw, sx = sum(w), sum(wi * b for wi, (b, _) in zip(w, points, strict=True))
    sy = sum(wi * t for wi, (_, t) in zip(w, points, strict=True))
    sxx = sum(wi * b * b for wi, (b, _) in zip(w, points, strict=True))
    sxy = sum(wi * b * t for wi, (b, t) in zip(w, points, strict=True))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    if slope <= 0:  # flat: all fixed cost
        return sy / sw, 0.0
    intercept = (sy - slope * sx) / sw
    if intercept < 0:  # through the origin
        return 0.0, sxy / sxx
    return intercept, slope


class _Stepper:
    """One batch size's model, optimizer and rows, stepping in windows."""

    def __init__(self, cfg: Config, dataset: Dataset, batch: int, device: torch.device) -> None:
        self.strategy = Strategy(device, cfg.train.precision)
        model = initial_model(cfg, dataset.input_shape, dataset.n_classes, dataset.vocab).to(device)
        self.optimizer = make_optimizer(cfg.train, model.parameters())
        self.net = self.strategy.setup(model)
        self.net.train()
        self.train = split_tensors(dataset.train, device)
        n = self.train[1].shape[0]
        self.order = torch.randperm(n, generator=torch.Generator().manual_seed(batch)).to(device)
        self.batch, self.at, self.steps = batch, 0, MIN_STEPS
        self.losses: list[torch.Tensor] = []

    def step(self) -> None:
        if self.at + self.batch > self.order.shape[0]:
            self.at = 0
        train_step(self.net, self.strategy, self.optimizer, self.train, self.order[self.at : self.at + self.batch],
                   self.losses)
        self.at += self.batch
        self.losses.clear()

    def window(self) -> float:
        return _window(self.step, self.steps, self.strategy.device)


class _Probing:
    """The noise probe's measurement at the initial weights (its cost does not depend on them)."""

    def __init__(self, cfg: Config, dataset: Dataset, device: torch.device) -> None:
        self.device = device
        model = initial_model(cfg, dataset.input_shape, dataset.n_classes, dataset.vocab).to(device).train()
        self.probe = FullSplitProbe(model, F.cross_entropy, *split_tensors(dataset.train, device))
        self.steps = 1

    def step(self) -> None:
        self.probe.measure(0)

    def window(self) -> float:
        return _window(self.step, self.steps, self.device)


def _window(step: Callable[[], None], steps: int, device: torch.device) -> float:
    """Seconds per step over a window of `steps` steps: on the CPU the median of the steps, each
    timed (a step a preemption cut into is an outlier the median passes over: load that comes and
    goes in scheduler slices falls on every batch size's steps alike); on a GPU, whose steps queue,
    the window's mean between two synchronizations."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize(device)
        return (time.perf_counter() - started) / steps
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(
    cfg: Config, dataset: Dataset, batch_sizes: Sequence[int], key: str, probe: bool = True, rounds: int = ROUNDS
) -> Table:
    """Time every batch size in `batch_sizes` (and the noise probe, with `probe`) side by side: a
    warm-up round that also sizes each window to ~WINDOW_SECONDS, then `rounds` rounds, each one
    window per entry, the order rotated each round. On this process's torch threads."""
    device = resolve_device(cfg.train)
    started, load_before = time.perf_counter(), os.getloadavg()
    timed: list[_Stepper | _Probing] = [_Stepper(cfg, dataset, b, device) for b in sorted(set(batch_sizes))]
    if probe:
        timed.append(_Probing(cfg, dataset, device))
    for item in timed:  # warm-up: the first window pays allocation and dispatch caches
        item.steps = max(MIN_STEPS if isinstance(item, _Stepper) else 1, math.ceil(WINDOW_SECONDS / item.window()))
    seconds: list[list[float]] = [[] for _ in timed]
    for r in range(rounds):
        for i in [(r + j) % len(timed) for j in range(len(timed))]:
            seconds[i].append(timed[i].window())
    entries = [
        Entry(item.batch if isinstance(item, _Stepper) else 0, item.steps, s)
        for item, s in zip(timed, seconds, strict=True)
    ]
    steps = [e for e in entries if e.batch_size]
    return Table(
        key, steps, next((e for e in entries if not e.batch_size), None), load_before, os.getloadavg(),
        os.cpu_count() or 1, torch.get_num_threads(), machine(), time.perf_counter() - started,
        fit_step_time([(e.batch_size, e.median) for e in steps]),
    )


def machine() -> str:
    """What the table's speeds depend on besides the config: the host, its processor and torch."""
    return f"{platform.node()}|{platform.machine()}|{platform.processor()}|torch {torch.__version__}"


def doublings(start: int, cap: int) -> list[int]:
    """start, 2·start, 4·start, ... up to `cap`: the batches an adaptive schedule can take."""
    sizes = [start]
    while sizes[-1] * 2 <= cap:
        sizes.append(sizes[-1] * 2)
    return sizes


def table_key(cfg: Config, dataset: Dataset, threads: int, *extra: object) -> str:
    """What a table's speeds depend on: the model, the data's shape, the step's strategy, precision,
    device, optimizer and accumulation, whether it probes, the threads and the machine (and `extra`)."""
    tc = cfg.train
    what = [cfg.model.model_dump(), list(dataset.input_shape), dataset.n_classes, dataset.vocab,
            int(dataset.train.y.shape[0]), tc.strategy, tc.precision, tc.device, tc.optimizer, tc.grad_accum_steps,
            tc.gns, threads, machine(), *extra]
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def with_step_time(cfg: Config, dataset: Dataset, cache: Path) -> Config:
    """`cfg` with train.adapt_step_time filled in where the time rule needs it and it is null: the fit
    of a table timed now over the batches the schedule can take (train.batch_size doubled up to its
    cap), kept in `cache` while its key holds, so a resumed run (whose checkpoint is keyed by the
    config) and a rerun read the same figures. The run logs it with its params: `reproduce` replays it."""
    tc = cfg.train
    if not (tc.adaptive_batch and tc.adapt_rule == "time" and tc.adapt_step_time is None):
        return cfg
    if tc.nnodes > 1:
        raise ConfigError("train.adapt_rule time on several machines needs the same step time on each: set "
                          "train.adapt_step_time: [a, b] (a one-machine `batchlab train` logs its fit)")
    n_train = int(dataset.train.y.shape[0])
    sizes = doublings(tc.batch_size, min(tc.max_batch_size or n_train, n_train))
    key = table_key(cfg, dataset, torch.get_num_threads(), sizes)
    raw = kept.read(cache, key)
    stored = Table.from_dict(raw) if raw is not None else None
    if stored is None:
        log.info("adaptive batch: timing batch sizes %s side by side for the time rule", ", ".join(map(str, sizes)))
        stored = measure(cfg, dataset, sizes, key)
        atomic.write_json(cache, stored.to_dict())
    log.info("adaptive batch: step time %.3f ms + %.3f µs x batch, %.2f ms a probe (train.adapt_step_time)",
             1e3 * stored.fit[0], 1e6 * stored.fit[1], 1e3 * stored.probe_seconds)
    return cfg.model_copy(update={"train": tc.model_copy(update={"adapt_step_time": stored.step_time()})})
