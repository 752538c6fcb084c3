"""An int8 copy of the ONNX model (onnxruntime.quantization), kept only when it scores within
export.quantize_max_f1_drop of the fp32 model on the test split.

At this width int8 buys size, not speed: on the default 10-64-64-2 MLP here the int8 files were
~2x smaller and no faster (slower at batch 1). The stage reports what it measures. The graph takes raw
examples (its preprocessing runs in float64 and stays float): calibration and scoring feed it those.
Both modes apply to the CNN (ConvInteger / QDQ Conv) and the transformer (its weight MatMuls) too.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from batchlab import atomic
from batchlab.config import ExportConfig
from batchlab.data import Dataset, unscaled
from batchlab.inference.predict import OnnxClassifier

CALIBRATION_BATCH = 256


class QuantizationError(RuntimeError):
    """The int8 model lost more test-split F1 than export.quantize_max_f1_drop allows."""


def int8_path(onnx_path: Path) -> Path:
    """models/model.onnx -> models/int8/model.int8.onnx. The folder is export's DVC output whether or not
    export.quantize is on (empty when off): DVC versions the int8 model like every other output."""
    return onnx_path.parent / "int8" / onnx_path.with_suffix(".int8.onnx").name


def _session(path: Path) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # as export's latency figures: one core
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@contextlib.contextmanager
def _no_root_info() -> Iterator[None]:
    """onnxruntime.quantization logs a note per tensor it leaves in float through the root logger, at INFO."""
    previous = logging.root.manager.disable
    logging.disable(logging.INFO)
    try:
        yield
    finally:
        logging.disable(previous)


def _quantize(fp32: Path, out: Path, mode: str, calibration: np.ndarray) -> None:
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Batches(CalibrationDataReader):
        def __init__(self) -> None:
            name = _session(fp32).get_inputs()[0].name
            self.batches = iter(
                {name: calibration[i : i + CALIBRATION_BATCH]} for i in range(0, len(calibration), CALIBRATION_BATCH)
            )

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.batches, None)

    with tempfile.TemporaryDirectory(prefix="batchlab-quantize-") as tmp, _no_root_info():
        prepared = Path(tmp) / "prepared.onnx"
        # symbolic shape inference is for dynamic shapes inside transformers (and needs sympy); the built-in
        # transformer quantizes without it (its shapes past the batch axis are static)
        quant_pre_process(str(fp32), str(prepared), skip_symbolic_shape=True)
        if mode == "dynamic":
            quantize_dynamic(str(prepared), str(out), weight_type=QuantType.QInt8)
        else:  # QDQ: ORT's CPU format; QOperator was ~6x slower on a full batch here
            quantize_static(str(prepared), str(out), Batches(), quant_format=QuantFormat.QDQ,
                            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
    # the feature and class names, the example shape: the int8 file is as usable by `batchlab predict`
    source, model = onnx.load(str(fp32)), onnx.load(str(out))
    del model.metadata_props[:]
    model.metadata_props.extend(source.metadata_props)
    onnx.save(model, str(out))


def _f1(path: Path, x: np.ndarray, y: np.ndarray) -> float:
    from sklearn.metrics import f1_score

    session = _session(path)
    logits = session.run(None, {session.get_inputs()[0].name: x})[0]
    return float(f1_score(y, logits.argmax(axis=1), average="macro"))


def latency_us(path: Path, x: np.ndarray, repeats: int = 200) -> dict[str, float]:
    """Median microseconds per onnxruntime call at batch 1 and on all of `x`."""
    session = _session(path)
    name = session.get_inputs()[0].name
    out = {}
    for label, batch, n in (("batch1", x[:1], repeats), ("full", x, max(5, repeats // 20))):
        times = []
        for _ in range(n):
            start = time.perf_counter()
            session.run(None, {name: batch})
            times.append(time.perf_counter() - start)
        out[label] = float(np.median(times) * 1e6)
    return out


def quantize_gated(fp32: Path, cfg: ExportConfig, dataset: Dataset) -> dict[str, Any] | None:
    """Write int8_path(fp32) when the int8 model's test macro-F1 is within cfg.quantize_max_f1_drop of the
    fp32 model's; otherwise raise QuantizationError. Returns the figures for the report (None: quantize none).
    Either way no int8 model of an earlier run is left."""
    out = int8_path(fp32)
    out.unlink(missing_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    fp32.with_suffix(".int8.onnx").unlink(missing_ok=True)  # where it was kept before 2026-12: not versioned
    if cfg.quantize == "none":
        return None
    prep = OnnxClassifier(fp32).prep
    scaler = {"mean": prep.mean, "std": prep.std}  # the graph takes raw examples: calibrate and score on those
    x_test, y_test = unscaled(dataset, scaler, dataset.test.x), dataset.test.y
    with atomic.atomic_path(out) as tmp:
        _quantize(fp32, tmp, cfg.quantize, unscaled(dataset, scaler, dataset.train.x))
        f1_fp32, f1_int8 = _f1(fp32, x_test, y_test), _f1(tmp, x_test, y_test)
        drop = f1_fp32 - f1_int8
        if drop > cfg.quantize_max_f1_drop:
            raise QuantizationError(
                f"the {cfg.quantize} int8 model loses {drop:.4f} test F1 (macro: {f1_fp32:.4f} -> {f1_int8:.4f}), more "
                f"than export.quantize_max_f1_drop={cfg.quantize_max_f1_drop}; no int8 model written"
            )
        fp32_latency, int8_latency = latency_us(fp32, x_test), latency_us(tmp, x_test)
        size = tmp.stat().st_size
    return {
        "mode": cfg.quantize,
        "file": str(out),
        "fp32_bytes": fp32.stat().st_size,
        "int8_bytes": size,
        "size_ratio": fp32.stat().st_size / size,
        "f1_macro_fp32": f1_fp32,
        "f1_macro_int8": f1_int8,
        "f1_drop": drop,
        "max_f1_drop": cfg.quantize_max_f1_drop,
        "latency_us": {
            f"{name}_{k}": v for name, lat in (("fp32", fp32_latency), ("int8", int8_latency)) for k, v in lat.items()
        },
    }
