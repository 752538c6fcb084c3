"""Every `batchlab <command>`: what it does, what it reads and writes (dvc.yaml's params, deps and
outs), its own arguments and the function that runs it, one table entry each (COMMANDS).

This module imports only the standard library: each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchlab.config import Config
    from batchlab.paths import Paths


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def ui_url(port: int, experiment: str | None, view: str | None = None) -> str:
    """The newest sweep's saved view (tracking/views.py) when there is one; else the runs table
    (MLflow 3's UI opens an experiment on its GenAI overview without workflowType)."""
    from batchlab.tracking import views

    base = f"http://127.0.0.1:{port}"
    if experiment is None:
        return base
    if view is not None:
        return f"{base}/{views.link(experiment, view)}"
    return f"{base}/#/experiments/{experiment}?workflowType=machine_learning"


Argument = tuple[tuple[str, ...], dict[str, Any]]


def _arg(*flags: str, **options: Any) -> Argument:
    """One of a command's own arguments, as argparse's add_argument takes it."""
    return flags, options


@dataclass(frozen=True)
class Command:
    summary: str
    files: str
    run: Callable[[argparse.Namespace], None]
    arguments: tuple[Argument, ...] = ()


def _config(args: argparse.Namespace) -> Config:
    from batchlab.config import load_config

    return load_config(args.params)


def _stage(args: argparse.Namespace) -> tuple[Config, Paths]:
    """The params and paths of a pipeline stage; MLflow's own logging quieted where it tracks."""
    from batchlab.paths import Paths

    cfg = _config(args)
    if cfg.tracking.enabled and args.stage != "generate":
        from batchlab.tracking import quiet_mlflow

        quiet_mlflow()
    return cfg, Paths(out=args.out)


def _validate(args: argparse.Namespace) -> None:  # runs on every params change: no torch, no mlflow
    from batchlab.validate import validate

    validate(_config(args))


def _generate(args: argparse.Namespace) -> None:
    from batchlab import stages

    stages.generate(*_stage(args))


def _train(args: argparse.Namespace) -> None:
    from batchlab import stages
    from batchlab.training import launch, tracked

    cfg, paths = _stage(args)
    if launch.is_worker():  # a rank under torchrun
        tracked.train_worker(cfg, paths)
    else:
        stages.train(cfg, paths)


def _evaluate(args: argparse.Namespace) -> None:
    from batchlab import stages

    stages.evaluate(*_stage(args))


def _export(args: argparse.Namespace) -> None:
    from batchlab import stages

    stages.export(*_stage(args))


def _sweep(args: argparse.Namespace) -> None:
    from batchlab.sweep.run import run_sweep  # scikit-learn and matplotlib: imported by this stage only
    from batchlab.training import launch

    cfg, paths = _stage(args)
    launch.apply_stage_threads(args.stage, cfg, paths.data)  # train, evaluate and export apply their own
    print(run_sweep(cfg, paths)["markdown"])  # the trade-off table, for the person who ran it


def _reproduce(args: argparse.Namespace) -> None:
    from batchlab.audit import reproduce
    from batchlab.tracking import quiet_mlflow, resolve_uri

    cfg = _config(args)
    quiet_mlflow()
    text, identical = reproduce.reproduce(args.run_id, resolve_uri(cfg.tracking))
    print(text)
    if not identical:
        raise reproduce.Differs(f"run {args.run_id} did not reproduce (the table above says where)")


def _verify(args: argparse.Namespace) -> None:
    from batchlab.audit import verify
    from batchlab.tracking import resolve_uri

    cfg = _config(args)
    print(verify.verify_outputs(args.out or Path("."), resolve_uri(cfg.tracking) if cfg.tracking.enabled else None))


def _noise_scale(args: argparse.Namespace) -> None:
    from batchlab.audit import noise

    _, paths = _stage(args)
    print(noise.report(paths, args.draws))


def _ui_url(args: argparse.Namespace) -> None:
    from batchlab.tracking import views
    from batchlab.tracking.backend import experiment_and_tags

    cfg = _config(args)
    found = experiment_and_tags(args.store, cfg.tracking.experiment)
    print(ui_url(args.port, None) if found is None else ui_url(args.port, found[0], views.newest(found[1])))


def _predict(args: argparse.Namespace) -> None:  # onnxruntime only: no torch; an ONNX file needs no params.yaml
    from batchlab.inference import predict

    if predict.is_mlflow_uri(args.model):
        from batchlab.config import load_config
        from batchlab.tracking import quiet_mlflow, resolve_uri
        from batchlab.tracking.pyfunc import onnx_file

        tracking_uri = resolve_uri(load_config(args.params).tracking)
        quiet_mlflow()
        with onnx_file(args.model, tracking_uri) as path:  # the session holds the model once built
            model = predict.load(str(path))
    else:
        model = predict.load(args.model)
    try:
        rows = predict.predict_file(model, args.input, args.output, args.chunk_rows)
    except BrokenPipeError:  # stdout piped into `head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return
    if args.output is not None:
        logging.getLogger("batchlab").info("predict: %d rows -> %s", rows, args.output)


# each command: what it does, what it reads and writes (dvc.yaml's params, deps and outs), the
# function that runs it and its own arguments
COMMANDS: dict[str, Command] = {
    "validate": Command(
        "check params.yaml before any stage removes its outputs (dvc.yaml's first stage)",
        "Reads params.yaml, data/raw (csv, npz) and usermodels/ (model.factory). Writes .batchlab/params.ok.",
        _validate,
    ),
    "generate": Command(
        "build the train/val/test split",
        "Reads params.yaml's data section and, for a csv or npz source, data/raw. Writes data/prepared/.",
        _generate,
    ),
    "train": Command(
        "train the model (DDP launches itself through torchrun)",
        "Reads params.yaml's model and train sections, data/prepared/, usermodels/. Writes "
        "models/model.pt, reports/history.csv, reports/train_summary.json and reports/train.json, and "
        "opens an MLflow run (tracking section) that evaluate and export add to.",
        _train,
    ),
    "evaluate": Command(
        "test-split metrics and confusion matrix",
        "Reads params.yaml's evaluate section, data/prepared/, usermodels/, models/model.pt. Writes "
        "reports/metrics.json, reports/predictions.csv and reports/confusion.png; logs them to train's "
        "MLflow run.",
        _evaluate,
    ),
    "export": Command(
        "ONNX export plus the onnxruntime parity gate, model registration",
        "Reads params.yaml's export section, data/prepared/, usermodels/, models/model.pt, "
        "reports/metrics.json. Writes models/model.onnx, models/int8/ (the int8 model under "
        "export.quantize), reports/export.json, logs the ONNX model and the `predictor` (raw rows in) to "
        "train's MLflow run and registers the predictor (the 'champion' alias when its test F1 is the "
        "best).",
        _export,
    ),
    "sweep": Command(
        "train at every sweep.batch_sizes and write the trade-off report",
        "Reads params.yaml's model, train and sweep sections, data/prepared/, usermodels/. Writes sweep/ "
        "(one folder per experiment, kept across runs so an interrupted sweep resumes) and "
        "reports/sweep/: reports/sweep/summary.md (the table, the verdict, the critical batch size), "
        "reports/sweep/sweep.json (the headline figures), reports/sweep/throughput.json (every batch size's "
        "speed, timed side by side first: the study's clock), the tables reports/sweep/summary.csv, "
        "reports/sweep/experiments.csv (each experiment's F1 by seed), reports/sweep/curves.csv and "
        "reports/sweep/steps_vs_examples.csv and reports/sweep/local_cbs.csv (sweep.local_cbs: the critical "
        "batch size through training, by branching), the charts reports/sweep/local_cbs.png, "
        "reports/sweep/f1_vs_batch.png, reports/sweep/val_loss_curves.png, reports/sweep/steps_vs_examples.png, "
        "reports/sweep/throughput_vs_batch.png, reports/sweep/memory_vs_batch.png and "
        "reports/sweep/noise_scale_curves.png; one MLflow parent run with the sweep's saved view, and a child "
        "run per experiment.",
        _sweep,
    ),
    "predict": Command(
        "predict raw feature rows with an ONNX model, through onnxruntime only",
        "Reads --model (an ONNX file such as models/model.onnx, which carries the scaler, or an MLflow "
        "URI: models:/batchlab-mlp@champion, runs:/<id>/predictor; the tracking section says where MLflow "
        "is) and --input (CSV or Parquet with the dataset's feature columns, .npy, or .npz's x for images "
        "and tokens). Writes --output (default stdout): a CSV of the other input columns, the class and a "
        "proba_<class> each.",
        _predict,
        (
            _arg("--model", required=True, help="ONNX file or MLflow model URI"),
            _arg("--input", required=True, type=Path, help=".csv, .parquet or .npy of raw features"),
            _arg("--output", type=Path, default=None, help="CSV to write (default: stdout)"),
            _arg("--chunk-rows", type=_positive, default=65_536, help="rows read and predicted at a time"),
        ),
    ),
    "reproduce": Command(
        "rebuild a tracked run from its record (commit, params, DVC data) and compare metrics and weights",
        "Reads the run (tracking section) and this git repo and DVC cache; rebuilds in a temporary git "
        "worktree at the run's commit (dvc repro generate, then train and evaluate). Prints `identical` "
        "(exit 0) or a table of what differs (exit 1); refuses a run made from a dirty tree (exit 2). "
        "Writes only new DVC cache entries here.",
        _reproduce,
        (_arg("run_id", metavar="RUN_ID", help="the MLflow run to rebuild (reports/train.json)"),),
    ),
    "verify": Command(
        "re-hash DVC's outputs and cache and the current MLflow run's models; name each mismatch (exit 1)",
        "Reads dvc.lock (and *.dvc files), the workspace outputs, the DVC cache, reports/train.json and, "
        "through the tracking section, that run's models and the digests export recorded. Writes nothing.",
        _verify,
    ),
    "noise-scale": Command(
        "the exact gradient noise scale of the trained model, from every train row's gradient",
        "Reads models/model.pt, data/prepared/ and reports/history.csv. Prints B_simple, |G|², tr(Σ) and "
        "the estimate training logged, with their ratio. Writes nothing.",
        _noise_scale,
        (_arg("--draws", type=_positive, default=8, help="dropout masks per row (default 8)"),),
    ),
    "ui-url": Command(
        "print the MLflow UI address that opens the newest sweep's charts, else tracking.experiment's runs "
        "table (`make ui` prints it)",
        "Reads params.yaml's tracking section and the MLflow store (read only; no mlflow import). Writes nothing.",
        _ui_url,
        (
            _arg("--store", default="sqlite:///mlflow.db", help="the MLflow store `mlflow ui` reads"),
            _arg("--port", type=int, default=5000, help="the port `mlflow ui` listens on"),
        ),
    ),
}
