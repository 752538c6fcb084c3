"""The pipeline's stages: read inputs, call the pure functions, write outputs atomically.

`batchlab <stage>` (dvc.yaml) and the Prefect flows both call these. Each stage imports what it
uses when it runs: `batchlab generate` starts without torch (~1 s) and mlflow.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from batchlab import atomic, data, kept, tracking
from batchlab import config as config_module
from batchlab.config import Config
from batchlab.paths import Paths
from batchlab.training import launch, tracked

log = logging.getLogger(__name__)


def generate_inputs_key(cfg: Config) -> str:
    """The data section plus the code that turns it into data: what generate's output depends on."""
    files = [f for m in (data, config_module) for f in sorted(Path(m.__file__ or "").parent.glob("*.py"))]
    code = b"".join(f.read_bytes() for f in files)
    return f"{cfg.section_hash('data')}-{hashlib.sha256(code).hexdigest()[:12]}"


def generated_is_current(cfg: Config, paths: Paths) -> bool:
    return kept.read(paths.data / "dataset.json", generate_inputs_key(cfg), field="inputs_key") is not None


def generate(cfg: Config, paths: Paths = Paths()) -> dict[str, Any]:
    dataset, scaler = data.build(cfg.data)
    summary = data.save(dataset, scaler, paths.data, generate_inputs_key(cfg))
    log.info("generate: %s rows %s, hash %s", cfg.data.source,
             {k: v["rows"] for k, v in summary["splits"].items()}, summary["content_hash"])
    return summary


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
    from batchlab.training import throughput  # torch: not for `batchlab generate`

    cfg = throughput.with_step_time(cfg, dataset, paths.outputs / ".batchlab" / "throughput.json")
    if cfg.train.node_rank > 0:  # another machine's ranks: node 0 tracks and writes every output
        tracked.check_trainable(cfg, dataset)
        launch.launch(cfg.train, tracked.rank_args(cfg, paths), paths.root, run_id=None)
        return {}
    tracked.check_trainable(cfg, dataset)
    with tracked.train_run(cfg, paths, dataset, parent_run_id, name, tags) as tracker:
        return tracked.train_in_run(cfg, paths, dataset, tracker).info


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
                                 "int8_onnxruntime_full_us": int8["latency_us"]["int8_full"]})
            tracker.log_artifact(int8["file"], "export")
        tracker.log_onnx_model(paths.onnx)
        # the predictor takes raw examples (rows by column name, images, token ids): its input example
        predictor_uri = tracker.log_predictor(paths.onnx, raw_test[:5])
        tracker.record_digests()  # every model of the run, train's included: `batchlab verify` checks them
        _register(cfg, paths, tracker, predictor_uri)
    log.info("export: %s, max |onnx - torch| = %.2e", paths.onnx, export_report["max_abs_diff"])
    return export_report
