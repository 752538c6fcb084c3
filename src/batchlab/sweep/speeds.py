"""The sweep's clock: the throughput table (training/throughput.py), measured side by side as the
sweep's first step and read by every figure in seconds (samples/s, seconds to the target, the
verdict's fastest, the recommendation).

It is a task of the sweep (tasks.Clock: in a lane, or on a Dask worker, where the experiments
train), kept in sweep/throughput.json (the sweep folder is DVC's, persisted), keyed by what a step's
speed depends on: the model, the data's shape, the strategy, precision, device, optimizer and
threads, the machine and the code. A resumed or re-reported sweep reads the same table, so its
seconds are the same; a change of any of those measures it anew. reports/sweep/throughput.json is
the report's copy.

DDP and FSDP sweeps keep each experiment's own epochs' median: the table times one process.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from batchlab import atomic, data, kept
from batchlab.config import Config
from batchlab.paths import Paths
from batchlab.sweep.plan import Experiment, code_hash
from batchlab.sweep.tasks import Clock
from batchlab.training import threads, throughput
from batchlab.training.throughput import Table

log = logging.getLogger(__name__)

TABLE = "throughput.json"


def table_path(paths: Paths) -> Path:
    return paths.outputs / "sweep" / TABLE


def batch_sizes(experiments: list[Experiment]) -> list[int]:
    """Every batch size a sweep's experiments train at: the fixed ones, and each an adaptive run may
    grow to (its start doubled up to its cap)."""
    sizes = {e.batch_size for e in experiments if not e.adaptive}
    for e in experiments:
        if e.adaptive:
            sizes.update(throughput.doublings(e.batch_size, e.max_batch_size or e.batch_size))
    return sorted(sizes)


def clock_work(cfg: Config, paths: Paths, experiments: list[Experiment], dataset: data.Dataset) -> Clock | None:
    """The task that times the sweep's throughput table, or None: the stored one's key holds and it
    has every batch size (a resumed or re-reported sweep reads the same clock), or the strategy is
    DDP/FSDP (each experiment's own epochs instead)."""
    if cfg.train.strategy != "single":
        log.info("sweep: samples/s from each experiment's own epochs (the throughput table times one process, "
                 "not train.strategy %s)", cfg.train.strategy)
        return None
    n = threads.sweep_threads(cfg, data.shape(paths.data))
    key = throughput.table_key(cfg, dataset, n, code_hash())
    sizes = batch_sizes(experiments)
    raw = kept.read(table_path(paths), key)
    if raw is not None and all(Table.from_dict(raw).entry(b) is not None for b in sizes):
        return None
    return Clock(tuple(sizes), key)


def stored(cfg: Config, paths: Paths) -> Table | None:
    """The sweep's throughput table as its task stored it (None under DDP/FSDP)."""
    if cfg.train.strategy != "single":
        return None
    return Table.from_dict(json.loads(table_path(paths).read_text()))


def measure(cfg: Config, paths: Paths, work: Clock) -> dict[str, Any]:
    """The clock task (groups.train_work, in a lane or on a Dask worker): the table timed on the
    sweep's threads, stored under the task's key and returned as stored."""
    dataset = data.load(paths.data)
    log.info("sweep: timing batch sizes %s side by side (the throughput table)", ", ".join(map(str, work.batch_sizes)))
    with threads.on_threads(threads.sweep_threads(cfg, data.shape(paths.data))):
        table = throughput.measure(cfg, dataset, work.batch_sizes, work.key, probe=cfg.train.gns)
    keep(paths, table.to_dict())
    log.info("sweep: throughput table in %.1f s (load %.2f -> %.2f): %s", table.seconds, table.load_before[0],
             table.load_after[0], ", ".join(f"{b}: {table.samples_per_s(b):.0f}/s" for b in work.batch_sizes))
    return table.to_dict()


def keep(paths: Paths, content: dict[str, Any]) -> None:
    """The clock task's table stored in the sweep folder under `paths` (the worker's, or the
    sweep's own when a Dask worker returned it)."""
    atomic.write_json(table_path(paths), content)
