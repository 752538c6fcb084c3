"""The pipeline's stages: read inputs, call the pure functions, write outputs atomically.

`batchlab <stage>` (dvc.yaml) and the Prefect flows both call these. Each stage imports what it
uses when it runs: `batchlab generate` starts without torch (~1 s) and mlflow.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchlab import atomic, data, tracking
from batchlab import config as config_module
from batchlab.config import Config, dump_config
from batchlab.paths import Paths
from batchlab.training import launch, threads
from batchlab.validate import batch_fits

if TYPE_CHECKING:
    from torch import nn

    from batchlab.training.train import TrainResult

log = logging.getLogger(__name__)


def generate_inputs_key(cfg: Config) -> str:
    """The data section plus the code that turns it into data: what generate's output depends on."""
    files = [f for m in (data, config_module) for f in sorted(Path(m.__file__ or "").parent.glob("*.py"))]
    code = b"".join(f.read_bytes() for f in files)
    return f"{cfg.section_hash('data')}-{hashlib.sha256(code).hexdigest()[:12]}"


def generated_is_current(cfg: Config, paths: Paths) -> bool:
    meta = paths.data / "dataset.json"
    return meta.is_file() and json.loads(meta.read_text()).get("inputs_key") == generate_inputs_key(cfg)


def generate(cfg: Config, paths: Paths = Paths()) -> dict[str, Any]:
    dataset, scaler = data.build(cfg.data)
    summary = data.save(dataset, scaler, paths.data, generate_inputs_key(cfg))
    log.info("generate: %s rows %s, hash %s", cfg.data.source,
             {k: v["rows"] for k, v in summary["splits"].items()}, summary["content_hash"])  # fmt: skip
    return summary


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
    from batchlab.training.train import write_curves

    save_model(paths.model, result.model, cfg.model, dataset.input_shape, dataset.class_names, dataset.vocab)
    atomic.write_csv(paths.reports / "history.csv", result.history)
    write_curves(result, paths.reports / "val_curve.csv", paths.curve_weights)
    summary = {**result.summary(), "torch_threads": torch.get_num_threads()}
    atomic.write_json(paths.reports / "train_summary.json", summary)
    discard(paths.checkpoint)  # the file, or the sharded folder beside it


def _rank_args(cfg: Config, paths: Paths) -> list[str]:
    """The one channel from launcher to ranks: the resolved config, threads included, written once."""
    count = cfg.train.threads or threads.threads_per_process(cfg.train.nproc)
    resolved = cfg.model_copy(update={"train": cfg.train.model_copy(update={"threads": count})})
    params = paths.outputs / ".batchlab" / "rank-params.yaml"
    atomic.write_text(params, dump_config(resolved))
    # ranks start in paths.root, so every path they are given is absolute
    return ["--params", str(params.resolve()), "--out", str(paths.outputs.resolve()), "train"]


def train(
    cfg: Config,
    paths: Paths = Paths(),
    parent_run_id: str | None = None,
    name: str | None = None,
    tags: dict[str, str] | None = None,
    dataset: data.Dataset | None = None,
) -> dict[str, Any]:
    """Train on the prepared data, in this process or, under `strategy: ddp|fsdp`, on ranks started by torchrun."""
    launch.apply_stage_threads("train", cfg, paths.data)  # the CLI and the flows alike
    dataset = dataset or data.load(paths.data)
    if cfg.train.node_rank > 0:  # another machine's ranks: node 0 tracks and writes every output
        _check_trainable(cfg, dataset)
        launch.launch(cfg.train, _rank_args(cfg, paths), paths.root, run_id=None)
        return {}
    with training(cfg, paths, dataset, parent_run_id, name, tags) as (_, trained):
        return trained.info


def _check_trainable(cfg: Config, dataset: data.Dataset) -> None:
    """Once, before any process starts or any run opens."""
    from batchlab.training.support import check_supported

    batch_fits(cfg.train.batch_size, dataset.train.y.shape[0], "train.batch_size")
    check_supported(cfg.train)


@contextlib.contextmanager
def training(
    cfg: Config,
    paths: Paths,
    dataset: data.Dataset,
    parent_run_id: str | None = None,
    name: str | None = None,
    tags: dict[str, str] | None = None,
) -> Iterator[tuple[tracking.Tracker, Trained]]:
    """Train and log the model, then yield the run, still open, with the training handed on: what
    the caller adds (a sweep experiment's scores) is recorded before the run ends FINISHED."""
    _check_trainable(cfg, dataset)
    with train_run(cfg, paths, dataset, parent_run_id, name, tags) as tracker:
        result = None
        if launch.uses_torchrun(cfg.train):
            launch.launch(cfg.train, _rank_args(cfg, paths), paths.root, tracker.run_id)
        else:
            result = train_worker(cfg, paths, tracker, dataset)
        yield tracker, log_trained(tracker, paths, dataset, result)


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
            **json.loads((paths.reports / "train_summary.json").read_text())}  # fmt: skip
    if info.get("batch_schedule"):  # train.adaptive_batch's decisions: a table in the run's Artifacts
        tracker.log_table(info["batch_schedule"], "batch_schedule.json")
    atomic.write_json(paths.run_info, info)
    if result is not None:
        return Trained(info, model, result.history, result.val_curve)
    history = [{k: float(v) for k, v in row.items()} for row in atomic.read_csv(paths.reports / "history.csv")]
    curve_file = paths.reports / "val_curve.csv"
    curve = atomic.read_csv(curve_file) if curve_file.is_file() else []
    return Trained(info, model, history, [{k: float(v) if v else math.nan for k, v in r.items()} for r in curve])


def _register(cfg: Config, paths: Paths, tracker: tracking.Tracker, predictor_uri: str | None) -> None:
    """Register the predictor (raw examples in) under tracking.registered_model, scored by evaluate's F1."""
    scores = paths.reports / "metrics.json"  # a dependency of export: evaluate ran on this model
    headline = f"f1_{cfg.evaluate.average}"
    if predictor_uri and not scores.is_file():
        log.warning("export: no %s (run `batchlab evaluate` first): the predictor is not registered", scores)
    elif predictor_uri and tracker.register(predictor_uri, json.loads(scores.read_text())[headline], headline):
        log.info("export: this model is the new %r", tracking.CHAMPION)


def _run_info(paths: Paths) -> dict[str, Any]:
    """What train handed on (reports/train.json): the MLflow run to log into, and the model's URI."""
    return json.loads(paths.run_info.read_text()) if paths.run_info.is_file() else {}


def evaluate(cfg: Config, paths: Paths = Paths()) -> dict[str, float]:
    from batchlab import evaluate as scoring  # scikit-learn: ~1 s to import, needed when scoring only

    launch.apply_stage_threads("evaluate", cfg, paths.data)
    dataset = data.load(paths.data)
    metrics, y_pred, class_names = scoring.score_test_split(paths.model, dataset)
    y_true = dataset.test.y
    run_id = _run_info(paths).get("run_id")
    with tracking.run(cfg.tracking, run_id=run_id, enabled=run_id is not None) as tracker:
        matrix = scoring.confusion(y_true, y_pred, len(class_names))
        scoring.save_confusion_png(matrix, class_names, paths.reports / "confusion.png")
        atomic.write_text(paths.reports / "predictions.csv", scoring.predictions_csv(y_true, y_pred, class_names))
        atomic.write_json(paths.reports / "metrics.json", metrics)
        tracker.log_metrics({f"test_{k}": v for k, v in metrics.items()})
        for name in ("metrics.json", "confusion.png"):
            tracker.log_artifact(paths.reports / name, "evaluation")
    log.info("evaluate: accuracy %.4f, f1_macro %.4f", metrics["accuracy"], metrics["f1_macro"])
    return metrics


def export(cfg: Config, paths: Paths = Paths()) -> dict[str, Any]:
    from batchlab.inference import export as onnx
    from batchlab.inference import predict, quantize
    from batchlab.model import load_model

    launch.apply_stage_threads("export", cfg, paths.data)
    dataset = data.load(paths.data)
    model, _ = load_model(paths.model)
    run_id = _run_info(paths).get("run_id")
    with tracking.run(cfg.tracking, run_id=run_id, enabled=run_id is not None) as tracker:
        # the graph scales raw examples itself; feature and class names travel in its metadata
        prep = predict.Preprocessing.from_dataset_json(paths.data / "dataset.json")
        raw_test = data.unscaled(dataset, {"mean": prep.mean, "std": prep.std}, dataset.test.x)
        export_report = onnx.export_checked(model, raw_test, prep, paths.onnx, cfg.export.opset, cfg.export.atol)
        predict.attach_preprocessing(paths.onnx, prep)
        export_report["file_bytes"] = paths.onnx.stat().st_size
        int8 = quantize.quantize_gated(paths.onnx, cfg.export, dataset)
        if int8 is not None:
            export_report["quantize"] = int8
        atomic.write_json(paths.reports / "export.json", export_report)
        latency = {f"export_{k}": v for k, v in export_report["latency"].items()}
        tracker.log_metrics(
            {
                "export_max_abs_diff": export_report["max_abs_diff"],
                "onnx_file_bytes": export_report["file_bytes"],
                **latency,
            }
        )
        tracker.log_artifact(paths.reports / "export.json", "export")
        if int8 is not None:
            tracker.log_metrics({"int8_file_bytes": int8["int8_bytes"], "int8_f1_drop": int8["f1_drop"],
                                 "int8_onnxruntime_batch1_us": int8["latency_us"]["int8_batch1"],
                                 "int8_onnxruntime_full_us": int8["latency_us"]["int8_full"]})  # fmt: skip
            tracker.log_artifact(int8["file"], "export")
        tracker.log_onnx_model(paths.onnx)
        # the predictor takes raw examples (rows by column name, images, token ids): its input example
        predictor_uri = tracker.log_predictor(paths.onnx, raw_test[:5])
        tracker.record_digests()  # every model of the run, train's included: `batchlab verify` checks them
        _register(cfg, paths, tracker, predictor_uri)
    log.info("export: %s, max |onnx - torch| = %.2e", paths.onnx, export_report["max_abs_diff"])
    return export_report
