"""The sweep's work items, decided once: the seeds of one batch size and lr multiplier trained
together (seeds/vectorized.py), or each experiment alone; and the lanes they run in.

Each seed still gets what an experiment trained alone gets (experiment.record): its MLflow child
run with the same params, tags, epoch metrics (at their epoch steps) and logged model, its folder
with model.pt, history.csv, val_curve.csv, train.json and result.json. The child runs are opened
once the group has trained: MLflow keeps one active run per thread, so sibling child runs cannot be
open at once, and a model is logged into the active run.

Where seeds cannot train together (support.seeds_train_apart: ddp, fp16/bf16, accumulation,
CUDA; or the model: BatchNorm, random draws of its own) or `sweep.vectorize_seeds` is false, each
experiment trains alone, and its speed is read from its own epochs.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, TypeVar

from batchlab import atomic, data, tracking
from batchlab.config import Config
from batchlab.paths import Paths
from batchlab.seeds import vectorized
from batchlab.sweep import branches, experiment, lock, speeds, truth
from batchlab.sweep.experiment import Stopwatch
from batchlab.sweep.plan import Experiment, Keyed, folder_of, keyed
from batchlab.sweep.tasks import Branches, Clock, Experiments, Lane, Truth, Work
from batchlab.training import threads, tracked
from batchlab.training.strategy import session
from batchlab.training.train import TrainResult

log = logging.getLogger(__name__)
T = TypeVar("T")


def groups(cfg: Config, todo: list[Experiment], apart: str | None) -> list[Experiments]:
    """The experiments to run, grouped by (batch size, lr multiplier) when their seeds can train
    together, else one per group. `apart`: why they cannot (None: they can), the sweep's one answer
    (run.prepare asks vectorized.sweep_trains_apart: a model other than the MLP is tried on a batch
    of the prepared train rows; one that must train its seeds apart, BatchNorm or its own random
    draws, is not grouped, so its seeds fill the lanes and each keeps its own wall time); said once."""
    if apart is not None:
        if cfg.sweep.vectorize_seeds and len(cfg.sweep.seeds) > 1:
            log.info("sweep: seeds train one after another: %s", apart)
        return [Experiments((exp,)) for exp in todo]
    together: dict[tuple[int, float], list[Experiment]] = {}
    for exp in todo:
        if not exp.adaptive:  # each adaptive seed's batch follows its own readings: it trains alone
            together.setdefault((exp.batch_size, exp.lr_multiplier), []).append(exp)
    alone = [(exp,) for exp in todo if exp.adaptive]
    return [Experiments(tuple(exps)) for exps in [*together.values(), *alone]]


def run_work(lane: Lane, work: Work) -> dict[str, Any]:
    """Every experiment's result row, by name: in this process, or in a fresh one with its share of
    the cores when sweep.parallel work items run at once."""
    if lane.cfg.sweep.parallel == 1:
        return train_work(lane, work)
    cores = threads.threads_per_process(lane.cfg.sweep.parallel)
    return threads.in_fresh_process(cores, experiment.with_sweep_threads, train_work, lane, work)


def train_work(lane: Lane, work: Work) -> dict[str, Any]:
    """What the task measured, claimed first (lock.claimed): a second copy of the task, run while the
    first still trains, waits and then finds it committed. Experiments: every result row, by name;
    seeds' local-CBS branches: their stored points by seed; the clock: the throughput table; an
    experiment's truth: its exact figures by step; each of the last three under the task's name."""
    match work:
        case Branches():
            with lock.claimed(lane.paths, [work.name]):  # on the threads every task here gets (run_work's callers)
                return {work.name: branches.run_seeds(lane.cfg, lane.paths, work)}
        case Experiments():
            with lock.claimed(lane.paths, [exp.name for exp in work.experiments]):
                return _train_claimed(lane, work)
        case Clock():
            with lock.claimed(lane.paths, [work.name]):
                return {work.name: speeds.measure(lane.cfg, lane.paths, work)}
        case Truth():
            with lock.claimed(lane.paths, [work.name]):
                return {work.name: truth.compute(lane.cfg, lane.paths, work)}


def keep(paths: Paths, work: Work, results: dict[str, Any]) -> None:
    """What a task stored on the worker that ran it (train_work's result), stored in the sweep's
    own folders too: a resume, and the report, find it even when the workers' folders are not these."""
    match work:
        case Branches():
            branches.keep(paths, results[work.name])
        case Experiments():
            for exp in work.experiments:
                if exp.name in results:
                    atomic.write_json(folder_of(paths, exp).outputs / "result.json", results[exp.name])
        case Clock():
            speeds.keep(paths, results[work.name])
        case Truth():
            truth.keep(paths, work, results[work.name])


def _train_claimed(lane: Lane, work: Experiments) -> dict[str, Any]:
    """Seeds that resume from the same epoch (0: a fresh start) train together; one alone trains as before."""
    if len(work) == 1:
        exp = work.experiments[0]
        return {exp.name: experiment.train_and_score(lane, exp)}
    dataset = data.load(lane.paths.data)
    data_hash = dataset.content_hash()
    jobs = [keyed(lane.cfg, exp, data_hash) for exp in work.experiments]  # each built once
    results: dict[str, Any] = {}
    for job in jobs:  # finished already: a task Dask runs again, a resumed sweep
        done = experiment.stored_result(lane, job.exp, job.key)
        if done is not None:
            results[job.exp.name] = done
    jobs = [job for job in jobs if job.exp.name not in results]
    checkpoints = [lane.folder(job.exp).checkpoint for job in jobs]
    epochs = vectorized.epochs_to_resume([job.cfg for job in jobs], dataset, checkpoints)
    for epoch in sorted(set(epochs)):
        part = [job for job, resumes in zip(jobs, epochs, strict=True) if resumes == epoch]
        if len(part) == 1:
            clock = Stopwatch(time.perf_counter())
            results[part[0].exp.name] = experiment.train_one(lane, part[0], dataset, clock)
        else:
            results.update(_train_together(lane, part, dataset))
    return results


def _train_together(lane: Lane, jobs: list[Keyed], dataset: data.Dataset) -> dict[str, Any]:
    started = time.perf_counter()
    folders = [lane.folder(job.exp) for job in jobs]
    if lane.cfg.train.threads:
        threads.use_threads(lane.cfg.train.threads)
    log.info("sweep: %s train together", ", ".join(job.exp.name for job in jobs))
    with session(jobs[0].cfg.train) as strategy:
        fitted = vectorized.fit_seeds([job.cfg for job in jobs], dataset, strategy,
                                      checkpoints=[f.checkpoint for f in folders])
    share = (time.perf_counter() - started) / len(jobs)  # each seed's part of the group's wall time
    tags = {"sweep.trained_with_seeds": str(len(jobs))}
    results = {}
    for job, folder, result in zip(jobs, folders, fitted, strict=True):
        clock = Stopwatch(time.perf_counter(), share)
        train = functools.partial(_log_fitted, job.cfg, folder, dataset, result)
        results[job.exp.name] = experiment.record(lane, job, dataset, train, clock, tags)
    return results


def _log_fitted(
    exp_cfg: Config, folder: Paths, dataset: data.Dataset, result: TrainResult, tracker: tracking.Tracker
) -> tracked.Trained:
    """A seed fitted with its group, recorded in its own run as if it had trained there: every epoch
    (a resumed group's earlier ones too), its outputs, its model."""
    for row in result.history:
        tracker.log_epoch(row, step=int(row["epoch"]))
    tracker.flush()
    tracked.write_trained(exp_cfg, folder, result, dataset)
    return tracked.log_trained(tracker, folder, dataset, result)


def lanes(experiments: list[T], parallel: int) -> list[list[T]]:
    """Split experiments (or groups of them) into `parallel` queues that run side by side, each one at a time."""
    return [experiments[i::parallel] for i in range(min(parallel, len(experiments)))]
