"""One tracked training: its MLflow run opened (or continued), the model trained in this process or
on torchrun's ranks, its outputs written and logged, the run handed on still open.

`batchlab train` (stages.train) and every sweep experiment train through here; the caller adds
what it measures (a sweep experiment's scores) before the run ends FINISHED.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchlab import atomic, data, tracking
from batchlab.config import Config, dump_config
from batchlab.paths import Paths
from batchlab.training import launch, threads
from batchlab.validate import batch_fits

if TYPE_CHECKING:
    from torch import nn

    from batchlab.training.train import TrainResult


def train_worker(
    cfg: Config, paths: Paths, tracker: tracking.Tracker | None = None, dataset: data.Dataset | None = None
) -> TrainResult | None:
    """One training process: the only one, or one rank under torchrun. Rank 0 writes the outputs
    and returns the result; the other ranks return None."""
    from batchlab.training.strategy import session
    from batchlab.training.train import fit

    if cfg.train.threads:
        threads.use_threads(cfg.train.threads)
    if dataset is None:  # a rank under torchrun reads it itself
        dataset = data.load(paths.data)
    with session(cfg.train) as strategy:
        if tracker is None:
            run_id = os.environ.get(launch.RUN_ID_ENV)
            tracker = tracking.attach(cfg.tracking, run_id) if run_id and strategy.is_main else tracking.Tracker()
        with strategy.collective_errors():
            result = fit(cfg, dataset, strategy, tracker, checkpoint=paths.checkpoint)
        tracker.flush()
        if not strategy.is_main:
            return None
        write_trained(cfg, paths, result, dataset)
        return result


def write_trained(cfg: Config, paths: Paths, result: TrainResult, dataset: data.Dataset) -> None:
    """A finished training's outputs: the model, its history and val curve, a summary; the checkpoint goes."""
    import torch

    from batchlab.model import save_model
    from batchlab.training.checkpoint import discard

    save_model(paths.model, result.model, cfg.model, dataset.input_shape, dataset.class_names, dataset.vocab)
    atomic.write_csv(paths.reports / "history.csv", result.history)
    write_curves(result, paths.reports / "val_curve.csv", paths.curve_weights)
    summary = {**result.summary(), "torch_threads": torch.get_num_threads()}
    atomic.write_json(paths.reports / "train_summary.json", summary)
    discard(paths.checkpoint)  # the file, or the sharded folder beside it


def write_curves(result: TrainResult, val_curve_csv: Path, weights_file: Path) -> None:
    """The val curve (train.eval_every_steps) and the weights at its points (train.curve_weights),
    or neither file where the run kept none: no stale file from an earlier run."""
    import torch

    from batchlab.model import save_torch

    if result.val_curve:
        atomic.write_csv(val_curve_csv, result.val_curve)
    else:
        val_curve_csv.unlink(missing_ok=True)
    if result.curve_weights:
        steps, weights = zip(*result.curve_weights, strict=True)
        save_torch(weights_file, {"steps": list(steps), "weights": torch.stack(weights)})
    else:
        weights_file.unlink(missing_ok=True)


def rank_args(cfg: Config, paths: Paths) -> list[str]:
    """The one channel from launcher to ranks: the resolved config, threads included, written once."""
    count = cfg.train.threads or threads.threads_per_process(cfg.train.nproc)
    resolved = cfg.model_copy(update={"train": cfg.train.model_copy(update={"threads": count})})
    params = paths.outputs / ".batchlab" / "rank-params.yaml"
    atomic.write_text(params, dump_config(resolved))
    # ranks start in paths.root, so every path they are given is absolute
    return ["--params", str(params.resolve()), "--out", str(paths.outputs.resolve()), "train"]


def check_trainable(cfg: Config, dataset: data.Dataset) -> None:
    """Once, before any process starts or any run opens."""
    from batchlab.training.support import check_supported

    batch_fits(cfg.train.batch_size, dataset.train.y.shape[0], "train.batch_size")
    check_supported(cfg.train)


def train_in_run(cfg: Config, paths: Paths, dataset: data.Dataset, tracker: tracking.Tracker) -> Trained:
    """Train into the open run `tracker`, here or on torchrun's ranks, and log what it made."""
    result = None
    if launch.uses_torchrun(cfg.train):
        launch.launch(cfg.train, rank_args(cfg, paths), paths.root, tracker.run_id)
    else:
        result = train_worker(cfg, paths, tracker, dataset)
    return log_trained(tracker, paths, dataset, result)


@contextlib.contextmanager
def train_run(
    cfg: Config,
    paths: Paths,
    dataset: data.Dataset,
    parent_run_id: str | None = None,
    name: str | None = None,
    tags: dict[str, str] | None = None,
) -> Iterator[tracking.Tracker]:
    """The MLflow run of one training, params, datasets and strategy tags logged; a training resumed
    from its checkpoint continues the run of the killed one."""
    from batchlab.training import resume
    from batchlab.training.support import describe
    from batchlab.training.train import fingerprint

    tc = cfg.train
    # what made it, then what it trained: `dvc-train-bs64-lr0.003-single-fp32`, `exp-<name>-train-...`
    origin = tracking.origin()
    name = name or f"{origin}-train-bs{tc.batch_size}-lr{tc.lr:g}-{tc.strategy}-{tc.precision}"
    tags = {**tracking.environment_tags(), "batchlab.origin": origin, **(tags or {})}
    previous = resume.find(paths.checkpoint, fingerprint(cfg, dataset))
    with tracking.run(cfg.tracking, name=name, parent_run_id=parent_run_id, tags=tags, resume=previous) as tracker:
        resume.remember(paths.checkpoint, tracker.run_id)
        if previous is None or tracker.run_id != previous.run_id:  # a continued run has them already
            tracker.log_params(cfg.flat())
            tracker.log_datasets(dataset, cfg.data.source)
        tracker.set_tags({f"train.{k}": v for k, v in describe(cfg.train).items()})
        yield tracker
    resume.forget(paths.checkpoint)


@dataclass(frozen=True)
class Trained:
    """A finished training, handed on in memory: train.json's contents, the saved model (model.pt,
    loaded once, on the CPU) and the history and val curve (the result's, or under torchrun the
    files rank 0 wrote)."""

    info: dict[str, Any]
    model: nn.Module
    history: list[dict[str, float]]
    val_curve: list[dict[str, float]]


def log_trained(
    tracker: tracking.Tracker, paths: Paths, dataset: data.Dataset, result: TrainResult | None = None
) -> Trained:
    """Log the trained model and its history into the training's run; write train.json."""
    from batchlab.model import load_model

    model, _ = load_model(paths.model)
    model_uri = tracker.log_torch_model(model, dataset.test.x[:5])
    tracker.log_artifact(paths.reports / "history.csv")
    info = {"run_id": tracker.run_id, "model_uri": model_uri,
            **json.loads((paths.reports / "train_summary.json").read_text())}
    if info.get("batch_schedule"):  # train.adaptive_batch's decisions: a table in the run's Artifacts
        tracker.log_table(info["batch_schedule"], "batch_schedule.json")
    atomic.write_json(paths.run_info, info)
    if result is not None:
        return Trained(info, model, result.history, result.val_curve)
    history = [{k: float(v) for k, v in row.items()} for row in atomic.read_csv(paths.reports / "history.csv")]
    curve_file = paths.reports / "val_curve.csv"
    curve = atomic.read_csv(curve_file) if curve_file.is_file() else []
    return Trained(info, model, history, [{k: float(v) if v else math.nan for k, v in r.items()} for r in curve])
