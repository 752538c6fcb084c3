"""ONNX export and the parity gate: onnxruntime must give torch's answers, or the stage fails."""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from batchlab import atomic

log = logging.getLogger(__name__)
PARITY_BATCHES = (1, 7, 0)  # 0 = every row at once


class ParityError(RuntimeError):
    """onnxruntime and torch disagree beyond the tolerance."""


@dataclass(frozen=True)
class ParityResult:
    batch: int
    max_abs_diff: float
    mismatched_predictions: int


# The TorchScript exporter (dynamo=False) writes this MLP (Gemm, activation, ..., Gemm) in ~0.05 s;
# the dynamo exporter writes the same nodes in ~2.7 s and first imports torch.export and onnxscript
# (~1.2 s more), and both pass the parity gate at the same max |diff| (benchmarks/bench_startup.py).
# TorchScript supports opsets up to 20 (and is deprecated since torch 2.9): newer opsets use dynamo.
TORCHSCRIPT_MAX_OPSET = 20


def export_onnx(model: nn.Module, input_shape: int | tuple[int, ...], path: str | Path, opset: int) -> None:
    """Write the model as ONNX with a dynamic batch axis (examples of `input_shape`: an int is rows of
    that many features), checked by onnx.checker."""
    import onnx

    model = model.eval().cpu()
    shape = (input_shape,) if isinstance(input_shape, int) else tuple(input_shape)
    # batch 2, not 1: an example batch of 1 specialises the batch axis (pytorch#148886)
    example = torch.zeros(2, *shape)
    if opset <= TORCHSCRIPT_MAX_OPSET:
        exporter: dict[str, Any] = {"dynamo": False, "dynamic_axes": {"features": {0: "batch"}, "logits": {0: "batch"}}}
    else:
        exporter = {"dynamo": True, "dynamic_shapes": ({0: torch.export.Dim("batch", min=1)},)}

    def write(tmp: Path) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript's deprecation notice; dynamo's chatter
            torch.onnx.export(
                model,
                (example,),
                str(tmp),
                input_names=["features"],
                output_names=["logits"],
                opset_version=opset,
                external_data=False,  # one self-contained file; the weights are small
                verbose=False,
                **exporter,
            )
        onnx.checker.check_model(str(tmp), full_check=True)

    for name in ("torch.onnx", "onnxscript", "onnx_ir"):  # exporter chatter, not our warnings
        logging.getLogger(name).setLevel(logging.ERROR)
    atomic.write_with(path, write)


def _session(path: str | Path) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def check_parity(model: nn.Module, onnx_path: str | Path, x: np.ndarray, atol: float) -> list[ParityResult]:
    """Compare logits on all of `x` at several batch sizes; raise ParityError beyond `atol`."""
    session = _session(onnx_path)
    model = model.eval().cpu()
    results = []
    for batch in PARITY_BATCHES:
        size = batch or x.shape[0]
        ort_out, torch_out = [], []
        for i in range(0, x.shape[0], size):
            chunk = x[i : i + size]
            ort_out.append(session.run(["logits"], {"features": chunk})[0])
            with torch.no_grad():
                torch_out.append(model(torch.from_numpy(chunk)).numpy())
        a, b = np.concatenate(ort_out), np.concatenate(torch_out)
        results.append(
            ParityResult(
                batch=size,
                max_abs_diff=float(np.abs(a - b).max()),
                mismatched_predictions=int((a.argmax(1) != b.argmax(1)).sum()),
            )
        )
    failed = [r for r in results if r.max_abs_diff > atol or r.mismatched_predictions]
    if failed:
        detail = "; ".join(
            f"batch {r.batch}: max |diff| {r.max_abs_diff:.2e}, {r.mismatched_predictions} predictions differ"
            for r in failed
        )
        raise ParityError(f"ONNX parity failed (export.atol={atol}): {detail}")
    return results


def latency_us(model: nn.Module, onnx_path: str | Path, x: np.ndarray, repeats: int = 200) -> dict[str, float]:
    """Median microseconds per call, batch 1 and full batch, onnxruntime vs torch eager."""
    session = _session(onnx_path)
    model = model.eval().cpu()
    out: dict[str, float] = {}
    for label, batch in (("batch1", x[:1]), ("full", x)):
        tensor = torch.from_numpy(batch)
        n = repeats if label == "batch1" else max(5, repeats // 20)
        for engine, call in (
            ("onnxruntime", lambda b=batch: session.run(["logits"], {"features": b})),
            ("torch", lambda t=tensor: model(t)),
        ):
            times = []
            with torch.no_grad():
                for _ in range(n):
                    start = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - start)
            out[f"{engine}_{label}_us"] = float(np.median(times) * 1e6)
    return out


def export_checked(model: nn.Module, x: np.ndarray, path: Path, opset: int, atol: float) -> dict[str, Any]:
    """Write the ONNX model, prove it gives torch's answers on `x` (none is left when it does not)
    and time both; export.json's figures."""
    export_onnx(model, tuple(x.shape[1:]), path, opset)
    try:
        parity = check_parity(model, path, x, atol)
    except ParityError:
        path.unlink(missing_ok=True)  # a model that disagrees with torch is not an output
        raise
    return {
        "opset": opset,
        "atol": atol,
        "parity": [p.__dict__ for p in parity],
        "max_abs_diff": max(p.max_abs_diff for p in parity),
        "latency": latency_us(model, path, x),
    }
