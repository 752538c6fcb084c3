"""`batchlab <stage>`: the commands dvc.yaml and people call.

Nothing but argparse is imported before the arguments are parsed, so `--help` and a usage
error answer at once; each stage then imports what it needs (validate: no torch, no mlflow; generate:
scikit-learn, no torch, no mlflow).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import NoReturn

BAD_INPUT = 2
# commands whose process may loop for hours outside a training loop, so it keeps collecting garbage
# throughout (batchlab.collector): the sweep's scheduler, predict's pass over an input of any size
LONG_LIVED = {"sweep", "predict"}

# what each command does, then what it reads and writes (dvc.yaml's params, deps and outs)
COMMANDS = {
    "validate": (
        "check params.yaml before any stage removes its outputs (dvc.yaml's first stage)",
        "Reads params.yaml, data/raw (csv, npz) and usermodels/ (model.factory). Writes .batchlab/params.ok.",
    ),
    "generate": (
        "build the train/val/test split",
        "Reads params.yaml's data section and, for a csv or npz source, data/raw. Writes data/prepared/.",
    ),
    "train": (
        "train the model (DDP launches itself through torchrun)",
        "Reads params.yaml's model and train sections, data/prepared/, usermodels/. Writes models/model.pt, "
        "reports/history.csv, reports/train_summary.json and reports/train.json, and opens an MLflow run "
        "(tracking section) that evaluate and export add to.",
    ),
    "evaluate": (
        "test-split metrics and confusion matrix",
        "Reads params.yaml's evaluate section, data/prepared/, usermodels/, models/model.pt. Writes "
        "reports/metrics.json, reports/predictions.csv and reports/confusion.png; logs them to train's MLflow run.",
    ),
    "export": (
        "ONNX export plus the onnxruntime parity gate, model registration",
        "Reads params.yaml's export section, data/prepared/, usermodels/, models/model.pt, reports/metrics.json. "
        "Writes models/model.onnx, models/int8/ (the int8 model under export.quantize), reports/export.json, logs "
        "the ONNX model and the `predictor` (raw rows in) to train's MLflow run and registers the predictor "
        "(the 'champion' alias when its test F1 is the best).",
    ),
    "sweep": (
        "train at every sweep.batch_sizes and write the trade-off report",
        "Reads params.yaml's model, train and sweep sections, data/prepared/, usermodels/. Writes sweep/ (one folder "
        "per experiment, kept across runs so an interrupted sweep resumes) and reports/sweep/: "
        "reports/sweep/summary.md (the table, the verdict, the critical batch size), reports/sweep/sweep.json "
        "(the headline figures), CSVs and "
        "plots; one MLflow parent run and a child run per experiment.",
    ),
    "predict": (
        "predict raw feature rows with an ONNX model, through onnxruntime only",
        "Reads --model (an ONNX file such as models/model.onnx, which carries the scaler, or an MLflow URI: "
        "models:/batchlab-mlp@champion, runs:/<id>/predictor; the tracking section says where MLflow is) and "
        "--input (CSV or Parquet with the dataset's feature columns, .npy, or .npz's x for images and tokens). "
        "Writes --output (default stdout): a CSV of the other input columns, the class and a proba_<class> each.",
    ),
    "reproduce": (
        "rebuild a tracked run from its record (commit, params, DVC data) and compare metrics and weights",
        "Reads the run (tracking section) and this git repo and DVC cache; rebuilds in a temporary git worktree "
        "at the run's commit (dvc repro generate, then train and evaluate). Prints `identical` (exit 0) or a "
        "table of what differs (exit 1); refuses a run made from a dirty tree (exit 2). Writes only new DVC cache "
        "entries here.",
    ),
    "verify": (
        "re-hash DVC's outputs and cache and the current MLflow run's models; name each mismatch (exit 1)",
        "Reads dvc.lock (and *.dvc files), the workspace outputs, the DVC cache, reports/train.json and, "
        "through the tracking section, that run's models and the digests export recorded. Writes nothing.",
    ),
    "noise-scale": (
        "the exact gradient noise scale of the trained model, from every train row's gradient",
        "Reads models/model.pt, data/prepared/ and reports/history.csv. Prints B_simple, |G|², tr(Σ) and the "
        "estimate training logged, with their ratio. Writes nothing.",
    ),
    "ui-url": (
        "print the MLflow UI address that opens tracking.experiment's runs table (`make ui` prints it)",
        "Reads params.yaml's tracking section and the MLflow store (read only; no mlflow import). Writes nothing.",
    ),
}


def _options(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """--params and --out, before or after the command. After it, they default to SUPPRESS: a
    subcommand's defaults would otherwise overwrite what was given before the command."""
    parser.add_argument(
        "--params",
        type=Path,
        default=Path("params.yaml") if defaults else argparse.SUPPRESS,
        help="params file (default params.yaml)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None if defaults else argparse.SUPPRESS,
        help="write models/ and reports/ under this folder instead of the current one",
    )


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


class _Parser(argparse.ArgumentParser):
    """A usage error is one line, as every other error (argparse prints the usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(BAD_INPUT, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="batchlab",
        description="batchlab pipeline stages: `dvc repro` runs them in order; `batchlab <command> --help` "
        "says what each one reads and writes.",
    )
    _options(parser, defaults=True)
    sub = parser.add_subparsers(dest="stage", required=True, metavar="<command>")
    for name, (summary, files) in COMMANDS.items():
        command = sub.add_parser(name, help=summary, description=f"{summary[0].upper()}{summary[1:]}. {files}")
        _options(command, defaults=False)
        if name == "predict":
            command.add_argument("--model", required=True, help="ONNX file or MLflow model URI")
            command.add_argument("--input", required=True, type=Path, help=".csv, .parquet or .npy of raw features")
            command.add_argument("--output", type=Path, default=None, help="CSV to write (default: stdout)")
            command.add_argument(
                "--chunk-rows", type=_positive, default=65_536, help="rows read and predicted at a time"
            )
        if name == "reproduce":
            command.add_argument("run_id", metavar="RUN_ID", help="the MLflow run to rebuild (reports/train.json)")
        if name == "noise-scale":
            command.add_argument("--draws", type=_positive, default=8, help="dropout masks per row (default 8)")
        if name == "ui-url":
            command.add_argument("--store", default="sqlite:///mlflow.db", help="the MLflow store `mlflow ui` reads")
            command.add_argument("--port", type=int, default=5000, help="the port `mlflow ui` listens on")
    return parser


def _terminate(signum: int, frame: FrameType | None) -> None:
    from batchlab.tracking import Interrupted

    raise Interrupted(f"signal {signum}")


def _configure_logging() -> None:
    """One line per stage on stderr. mlflow sets its own logger's level and handler when it is
    imported (after this runs), so its level is given through its own variable, which its
    children inherit too."""
    level = os.environ.get("BATCHLAB_LOG", "INFO")
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr)
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    for noisy in ("mlflow", "alembic", "urllib3", "git", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def ui_url(port: int, experiment: str | None) -> str:
    """MLflow 3's UI opens an experiment on its GenAI overview; this parameter opens the runs table."""
    base = f"http://127.0.0.1:{port}"
    return base if experiment is None else f"{base}/#/experiments/{experiment}?workflowType=machine_learning"


def run(args: argparse.Namespace) -> None:
    from batchlab.config import load_config

    if args.stage == "predict":  # onnxruntime only: no torch; a local ONNX file needs no params.yaml
        _predict(args)
        return
    cfg = load_config(args.params)
    if args.stage == "validate":  # runs on every params change: no torch, no mlflow
        from batchlab.validate import validate

        validate(cfg)
        return
    if args.stage == "reproduce":
        from batchlab.audit import reproduce
        from batchlab.tracking import quiet_mlflow, resolve_uri

        quiet_mlflow()
        text, identical = reproduce.reproduce(args.run_id, resolve_uri(cfg.tracking))
        print(text)
        if not identical:
            raise reproduce.Differs(f"run {args.run_id} did not reproduce (the table above says where)")
        return
    if args.stage == "verify":
        from batchlab.audit import verify
        from batchlab.tracking import resolve_uri

        print(verify.verify_outputs(args.out or Path("."), resolve_uri(cfg.tracking) if cfg.tracking.enabled else None))
        return
    if args.stage == "ui-url":
        from batchlab.tracking.backend import experiment_id

        print(ui_url(args.port, experiment_id(args.store, cfg.tracking.experiment)))
        return
    from batchlab import stages
    from batchlab.training import launch

    if cfg.tracking.enabled and args.stage != "generate":
        from batchlab.tracking import quiet_mlflow

        quiet_mlflow()
    paths = stages.Paths(out=args.out)
    if args.stage == "sweep":  # train, evaluate and export apply their own
        launch.apply_stage_threads(args.stage, cfg, paths.data)
    if args.stage == "generate":
        stages.generate(cfg, paths)
    elif args.stage == "train":
        if launch.is_worker():
            stages.train_worker(cfg, paths)
        else:
            stages.train(cfg, paths)
    elif args.stage == "evaluate":
        stages.evaluate(cfg, paths)
    elif args.stage == "export":
        stages.export(cfg, paths)
    elif args.stage == "noise-scale":
        from batchlab.audit import noise

        print(noise.report(paths, args.draws))
    elif args.stage == "sweep":
        from batchlab.sweep.run import run_sweep  # scikit-learn and matplotlib: imported by this stage only

        print(run_sweep(cfg, paths)["markdown"])  # the trade-off table, for the person who ran it


def _predict(args: argparse.Namespace) -> None:
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


def _status(args: argparse.Namespace) -> int:
    # the error types: none of these modules imports torch or mlflow
    from batchlab import tracking
    from batchlab.config import ConfigError
    from batchlab.data import DataError
    from batchlab.training import launch

    signal.signal(signal.SIGTERM, _terminate)
    try:
        run(args)
    except (ConfigError, DataError) as err:
        print(f"batchlab: error: {err}", file=sys.stderr)
        return BAD_INPUT
    except (tracking.TrackingUnavailable, launch.LaunchError, RuntimeError, FileNotFoundError) as err:
        print(f"batchlab: error: {err}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, tracking.Interrupted):
        print("batchlab: interrupted", file=sys.stderr)
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command in `argv` and return its exit status. Without `argv` this is the program
    (the `batchlab` script, `python -m batchlab.cli`): it reads sys.argv and ends the process."""
    # --help and usage errors exit here, before anything heavier than argparse is imported
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if argv is None and args.stage not in LONG_LIVED:
        from batchlab import collector

        collector.pause()  # this process's own: its libraries load without full collections
    _configure_logging()
    status = _status(args)
    if argv is None:
        from batchlab import collector

        collector.exit_now(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
