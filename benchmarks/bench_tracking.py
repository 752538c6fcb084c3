"""MLflow tracking on vs off at the default params: per-epoch logging apart from one-off costs.

Everything runs in a temporary folder with a temporary SQLite store, so the repo's own
mlflow.db and outputs are untouched. Variants alternate and the median of REPEATS is kept.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from batchlab import data, stages, tracking
from batchlab.config import Config, load_config
from batchlab.model import build_model
from batchlab.paths import Paths
from batchlab.tracking.mlflow_tracker import MlflowTracker
from batchlab.training.strategy import Strategy
from batchlab.training.train import fit
from common import REPO, Table, markdown, progress, timed, verdict, working_dir

REPEATS = 3
PER_EPOCH_TARGET = 0.03  # issue: per-epoch logging costs at most 3% of training wall time


class TimedMlflowTracker(MlflowTracker):
    """Adds up the seconds fit() spends handing its epochs to MLflow."""

    seconds = 0.0

    def log_epoch(self, metrics: Mapping[str, float], step: int) -> None:
        started = time.perf_counter()
        super().log_epoch(metrics, step)
        self.seconds += time.perf_counter() - started

    def flush(self) -> None:
        started = time.perf_counter()
        super().flush()
        self.seconds += time.perf_counter() - started


def with_tracking(cfg: Config, enabled: bool, uri: str) -> Config:
    section = cfg.tracking.model_copy(update={"enabled": enabled, "tracking_uri": uri})
    return cfg.model_copy(update={"tracking": section})


def import_seconds() -> float:
    """`import mlflow` in a fresh process: every `batchlab` command that tracks pays it once."""
    code = "import time; t = time.perf_counter(); import mlflow; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return float(out)


def one_off_costs(cfg: Config, root: Path, dataset: data.Dataset) -> dict[str, float]:
    progress("tracking: one-off costs")
    stores = [timed(lambda i=i: tracking.prepare_backend(f"sqlite:///{root}/store{i}.db"))[1] for i in range(REPEATS)]
    model = build_model(cfg.model, dataset.n_features, dataset.n_classes)
    with tracking.run(cfg.tracking, name="bench-model-logging") as tracker:
        # the first call also imports mlflow.pytorch and its dependencies
        logs = [timed(lambda: tracker.log_torch_model(model, dataset.test.x[:5]))[1] for _ in range(REPEATS + 1)]
    return {
        "import_mlflow_s": import_seconds(),
        "store_creation_s": statistics.median(stores),
        "log_model_first_s": logs[0],
        "log_model_s": statistics.median(logs[1:]),
    }


def per_epoch_costs(cfg: Config, dataset: data.Dataset) -> dict[str, Any]:
    """fit() with a real MLflow tracker vs a do-nothing Tracker; the run is opened outside the timing."""
    strategy = Strategy(torch.device("cpu"))
    fit(cfg, dataset, strategy)  # warm-up: the first fit in a process pays torch's lazy setup
    null, logged, logging = [], [], []
    epochs = 0
    for repeat in range(REPEATS):
        progress(f"tracking: fit() with and without MLflow, repeat {repeat + 1}/{REPEATS}")
        null.append(timed(lambda: fit(cfg, dataset, strategy, tracking.Tracker()))[1])
        with tracking.run(cfg.tracking, name="bench-per-epoch") as run:
            tracker = TimedMlflowTracker(str(run.run_id), cfg.tracking)
            # the last epochs' metrics are written at the end, as train_worker does
            result, seconds = timed(lambda t=tracker: (fit(cfg, dataset, strategy, t), t.flush())[0])
        logged.append(seconds)
        logging.append(tracker.seconds)
        epochs = len(result.history)
    return {
        "epochs": epochs,
        "fit_null_s": statistics.median(null),
        "fit_mlflow_s": statistics.median(logged),
        "log_epoch_total_s": statistics.median(logging),
        "repeats": {"fit_null_s": null, "fit_mlflow_s": logged, "log_epoch_total_s": logging},
    }


def stage_costs(on: Config, off: Config, paths: Paths) -> dict[str, float]:
    """The whole train stage: run creation, params, datasets, per-epoch metrics, model logging."""
    stages.train(on, paths)  # warm-up: imports and the experiment's first run
    stages.train(off, paths)
    walls: dict[str, list[float]] = {"on": [], "off": []}
    for repeat in range(REPEATS):
        progress(f"tracking: train stage on/off, repeat {repeat + 1}/{REPEATS}")
        walls["on"].append(timed(lambda: stages.train(on, paths))[1])
        walls["off"].append(timed(lambda: stages.train(off, paths))[1])
    return {
        "stage_on_s": statistics.median(walls["on"]),
        "stage_off_s": statistics.median(walls["off"]),
        "stage_repeats": walls,
    }


def main() -> dict[str, Any]:
    logging.getLogger("mlflow").setLevel(logging.WARNING)  # store migrations log every table at INFO
    # one thread (params say 0 = torch's default, 2 here): when a neighbour takes a core, two-thread
    # kernels stall on each other and that noise is larger than the overhead measured
    torch.set_num_threads(1)
    base = load_config(REPO / "params.yaml")
    with tempfile.TemporaryDirectory() as tmp, working_dir(Path(tmp)), mock.patch.dict(os.environ):
        os.environ.pop("MLFLOW_TRACKING_URI", None)  # it would override the temporary store
        root = Path(tmp)
        params = root / "params.yaml"
        shutil.copy(REPO / "params.yaml", params)
        uri = f"sqlite:///{root / 'mlflow.db'}"
        on, off = with_tracking(base, True, uri), with_tracking(base, False, uri)
        paths = Paths(root)
        stages.generate(off, paths)
        dataset = data.load(paths.data)
        once = one_off_costs(on, root, dataset)
        epoch = per_epoch_costs(on, dataset)
        stage = stage_costs(on, off, paths)

    train_s = epoch["fit_null_s"]
    share = epoch["log_epoch_total_s"] / train_s
    tc = base.train
    overhead = Table(
        f"Tracking overhead, default params ({epoch['epochs']} epochs of batch {tc.batch_size}, "
        f"{base.data.samples} rows, 1 thread; median of {REPEATS})",
        ["part", "tracking off s", "tracking on s", "overhead s", "overhead %"],
    )
    fit_extra = epoch["fit_mlflow_s"] - train_s
    overhead.add(
        "fit(), per-epoch logging",
        f"{train_s:.3f}",
        f"{epoch['fit_mlflow_s']:.3f}",
        f"{fit_extra:+.3f}",
        f"{100 * fit_extra / train_s:+.1f}%",
    )
    overhead.add("… of which inside log_epoch", "", "", f"{epoch['log_epoch_total_s']:.3f}", f"{100 * share:.1f}%")
    stage_extra = stage["stage_on_s"] - stage["stage_off_s"]
    overhead.add(
        "train stage (store exists, imports warm)",
        f"{stage['stage_off_s']:.3f}",
        f"{stage['stage_on_s']:.3f}",
        f"{stage_extra:+.3f}",
        f"{100 * stage_extra / stage['stage_off_s']:+.1f}%",
    )
    one_off = Table("Tracking one-off costs", ["cost", "seconds"])
    one_off.add("`import mlflow` (once per process)", f"{once['import_mlflow_s']:.2f}")
    one_off.add("create a SQLite store (migrations)", f"{once['store_creation_s']:.2f}")
    one_off.add("log_torch_model, first in a process", f"{once['log_model_first_s']:.2f}")
    one_off.add("log_torch_model, later", f"{once['log_model_s']:.2f}")
    targets = Table("Tracking targets", ["target", "measured", "result"])
    targets.add(
        f"per-epoch logging ≤ {PER_EPOCH_TARGET:.0%} of training", f"{share:.1%}", verdict(share <= PER_EPOCH_TARGET)
    )
    return {
        "tables": [overhead.as_dict(), one_off.as_dict(), targets.as_dict()],
        "measured": {**once, **epoch, **stage, "per_epoch_share": share},
    }


if __name__ == "__main__":
    print(markdown(main()["tables"]))
