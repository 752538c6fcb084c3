"""The sweep's seeds of one batch size and lr multiplier, trained together (seeds/vectorized.py).

Each seed still gets what experiment.train_and_score gives an experiment trained alone: its MLflow
child run with the same params, tags, epoch metrics (at their epoch steps) and logged model,
its folder with model.pt, history.csv, val_curve.csv, train.json and result.json. The child
runs are opened once the group has trained: MLflow keeps one active run per thread, so sibling
child runs cannot be open at once, and a model is logged into the active run.

Where seeds cannot train together (support.seeds_train_apart: ddp, fp16/bf16, accumulation,
CUDA; or the model: BatchNorm, random draws of its own) or `sweep.vectorize_seeds` is false, each
experiment trains alone, as before.
"""

from __future__ import annotations

import logging
import time
from typing import Any, TypeVar

import torch

from batchlab import data, stages
from batchlab.config import Config
from batchlab.seeds import vectorized
from batchlab.seeds.vectorized import trains_together
from batchlab.sweep import experiment, scoring
from batchlab.sweep.experiment import Experiment
from batchlab.training import threads
from batchlab.training.strategy import Strategy, session
from batchlab.training.support import seeds_train_apart

log = logging.getLogger(__name__)
T = TypeVar("T")


def groups(cfg: Config, todo: list[Experiment], paths: stages.Paths) -> list[list[Experiment]]:
    """The experiments to run, grouped by (batch size, lr multiplier) when their seeds can train
    together, else one per group; says once why they cannot. A model other than the MLP is tried
    on a batch of the prepared train rows (seeds/functional.why_apart): one that must train its
    seeds apart (BatchNorm, its own random draws) is not grouped, so its seeds fill the lanes and
    each keeps its own wall time."""
    reason, grouped = seeds_train_apart(cfg), trains_together(cfg)
    if grouped and not cfg.model.is_mlp():
        dataset = data.load(paths.data)
        rows = torch.from_numpy(dataset.train.x[: cfg.train.batch_size])
        reason = vectorized.model_trains_apart(cfg, dataset, Strategy(torch.device("cpu")), rows)
        grouped = reason is None
    if not grouped:
        if reason is not None and cfg.sweep.vectorize_seeds and len(cfg.sweep.seeds) > 1:
            log.info("sweep: seeds train one after another: %s", reason)
        return [[exp] for exp in todo]
    together: dict[tuple[int, float], list[Experiment]] = {}
    for exp in todo:
        if not exp.adaptive:  # each adaptive seed's batch follows its own readings: it trains alone
            together.setdefault((exp.batch_size, exp.lr_multiplier), []).append(exp)
    return list(together.values()) + [[exp] for exp in todo if exp.adaptive]


def run_group(cfg: Config, exps: list[Experiment], paths: stages.Paths, parent_run_id: str | None) -> dict[str, Any]:
    """Every experiment's result row, by name: in this process, or in a fresh one with its share of
    the cores when sweep.parallel groups run at once (as experiment.run_experiment does for one)."""
    if len(exps) == 1:
        return {exps[0].name: experiment.run_experiment(cfg, exps[0], paths, parent_run_id)}
    if cfg.sweep.parallel == 1:
        return train_group(cfg, exps, paths, parent_run_id)
    cores = threads.threads_per_process(cfg.sweep.parallel)
    return threads.in_fresh_process(cores, experiment.with_sweep_threads, train_group, cfg, exps, paths, parent_run_id)


def train_group(cfg: Config, exps: list[Experiment], paths: stages.Paths, parent_run_id: str | None) -> dict[str, Any]:
    """Seeds that resume from the same epoch (0: a fresh start) train together; one alone trains as before."""
    dataset = data.load(paths.data)
    data_hash = dataset.content_hash()
    cfgs = {exp.name: experiment.experiment_config(cfg, exp) for exp in exps}  # each built once
    keys = {name: experiment.key_of(exp_cfg, data_hash) for name, exp_cfg in cfgs.items()}
    results: dict[str, Any] = {}
    for exp in exps:  # finished already: a task Dask runs again, a resumed sweep
        done = experiment.stored_result(cfg, exp, paths, parent_run_id, keys[exp.name])
        if done is not None:
            results[exp.name] = done
    exps = [exp for exp in exps if exp.name not in results]
    checkpoints = [experiment.experiment_paths(paths, exp).checkpoint for exp in exps]
    epochs = vectorized.epochs_to_resume([cfgs[exp.name] for exp in exps], dataset, checkpoints)
    for epoch in sorted(set(epochs)):
        part = [exp for exp, resumes in zip(exps, epochs, strict=True) if resumes == epoch]
        if len(part) == 1:
            exp, started = part[0], time.perf_counter()
            results[exp.name] = experiment.train_one(
                cfg, exp, cfgs[exp.name], keys[exp.name], paths, parent_run_id, dataset, started
            )
        else:
            results.update(_train_together(cfg, part, cfgs, keys, paths, parent_run_id, dataset))
    return results


def _train_together(
    cfg: Config,
    exps: list[Experiment],
    cfgs: dict[str, Config],
    keys: dict[str, str],
    paths: stages.Paths,
    parent_run_id: str | None,
    dataset: data.Dataset,
) -> dict[str, Any]:
    started = time.perf_counter()
    exp_cfgs = [cfgs[exp.name] for exp in exps]
    folders = [experiment.experiment_paths(paths, exp) for exp in exps]
    if cfg.train.threads:
        threads.use_threads(cfg.train.threads)
    log.info("sweep: %s train together", ", ".join(exp.name for exp in exps))
    with session(exp_cfgs[0].train) as strategy:
        fitted = vectorized.fit_seeds(exp_cfgs, dataset, strategy, checkpoints=[f.checkpoint for f in folders])
    share = (time.perf_counter() - started) / len(exps)  # each seed's part of the group's wall time
    results = {}
    for exp, exp_cfg, folder, result in zip(exps, exp_cfgs, folders, fitted, strict=True):
        begun = time.perf_counter()
        key = keys[exp.name]
        tags = {**experiment.experiment_tags(exp, key), "sweep.trained_with_seeds": str(len(exps))}
        with stages.train_run(exp_cfg, folder, dataset, parent_run_id, f"sweep-{exp.name}", tags) as tracker:
            for row in result.history:  # every epoch, a resumed group's earlier ones too
                tracker.log_epoch(row, step=int(row["epoch"]))
            tracker.flush()
            stages.write_trained(exp_cfg, folder, result, dataset)
            trained = stages.log_trained(tracker, folder, dataset, result)
            measured = experiment.measure(cfg, exp_cfg, dataset, trained.history)
            seconds = share + time.perf_counter() - begun
            scored = scoring.score(exp, key, trained, dataset, measured, seconds, tracker)
        experiment.fully_recorded(exp, tracker)
        results[exp.name] = experiment.keep(cfg, paths, exp, scored)
    return results


def lanes(experiments: list[T], parallel: int) -> list[list[T]]:
    """Split experiments (or groups of them) into `parallel` queues that run side by side, each one at a time."""
    return [experiments[i::parallel] for i in range(min(parallel, len(experiments)))]
