"""ONNX export and the parity gate: onnxruntime must give torch's answers, or the stage fails.

The graph takes raw examples (rows and images float64, token ids int64) and holds the train split's
scaler itself, in the arithmetic of data.build (float64 (x - mean) / std, then float32), so any ONNX
runtime predicts from the file alone."""

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
from batchlab.inference.predict import Preprocessing

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


class RawInput(nn.Module):
    """The network behind its preprocessing: raw examples in, as `batchlab predict` reads them. Rows and
    images: (x - mean) / std in float64 per feature or per channel, then float32, as data.build scales
    the splits; token ids: int64 in, float32 ids to the network (as every prepared array), unscaled."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, network: nn.Module, prep: Preprocessing) -> None:
        super().__init__()
        self.network = network
        self.scaled = prep.kind != "tokens"
        per = (-1, *([1] * (len(prep.shape) - 1))) if prep.kind == "images" else (-1,)
        self.register_buffer("mean", torch.tensor(prep.mean, dtype=torch.float64).reshape(per))
        self.register_buffer("std", torch.tensor(prep.std, dtype=torch.float64).reshape(per))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scaled:
            x = (x - self.mean) / self.std
        return self.network(x.to(torch.float32))


def export_onnx(model: nn.Module, prep: Preprocessing | int, path: str | Path, opset: int) -> None:
    """Write the model as ONNX with a dynamic batch axis, checked by onnx.checker: behind its
    preprocessing (RawInput), or an int: the bare network on rows of that many float32 features."""
    import onnx

    model = model.eval().cpu()
    if isinstance(prep, int):
        example = torch.zeros(2, prep)  # batch 2, not 1: a batch of 1 specialises the batch axis (pytorch#148886)
    else:
        model = RawInput(model, prep).eval()
        example = torch.zeros(2, *prep.shape, dtype=torch.int64 if prep.kind == "tokens" else torch.float64)
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


def check_parity(
    model: nn.Module, onnx_path: str | Path, x: np.ndarray, atol: float, raw: np.ndarray | None = None
) -> list[ParityResult]:
    """Compare logits at several batch sizes, torch's on all of `x` against onnxruntime's on `raw`, the
    same examples before preprocessing (None: the graph takes `x` itself); ParityError beyond `atol`."""
    session = _session(onnx_path)
    model = model.eval().cpu()
    raw = x if raw is None else raw
    results = []
    for batch in PARITY_BATCHES:
        size = batch or x.shape[0]
        ort_out, torch_out = [], []
        for i in range(0, x.shape[0], size):
            ort_out.append(session.run(["logits"], {"features": raw[i : i + size]})[0])
            with torch.no_grad():
                torch_out.append(model(torch.from_numpy(x[i : i + size])).numpy())
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


def latency_us(
    model: nn.Module, onnx_path: str | Path, x: np.ndarray, repeats: int = 200, raw: np.ndarray | None = None
) -> dict[str, float]:
    """Median microseconds per call, batch 1 and full batch, onnxruntime (on `raw`, default `x`) vs torch
    eager (on `x`)."""
    session = _session(onnx_path)
    model = model.eval().cpu()
    raw = x if raw is None else raw
    out: dict[str, float] = {}
    for label, batch, raw_batch in (("batch1", x[:1], raw[:1]), ("full", x, raw)):
        tensor = torch.from_numpy(batch)
        n = repeats if label == "batch1" else max(5, repeats // 20)
        for engine, call in (
            ("onnxruntime", lambda b=raw_batch: session.run(["logits"], {"features": b})),
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


def export_checked(
    model: nn.Module, raw: np.ndarray, prep: Preprocessing, path: Path, opset: int, atol: float
) -> dict[str, Any]:
    """Write the ONNX model (preprocessing inside), prove that onnxruntime on the raw examples `raw`
    gives torch's answers on them preprocessed (none is left when it does not) and time both; export.json's
    figures."""
    x = prep.network_input(raw)
    export_onnx(model, prep, path, opset)
    try:
        parity = check_parity(model, path, x, atol, raw=raw)
    except ParityError:
        path.unlink(missing_ok=True)  # a model that disagrees with torch is not an output
        raise
    return {
        "opset": opset,
        "atol": atol,
        "parity": [p.__dict__ for p in parity],
        "max_abs_diff": max(p.max_abs_diff for p in parity),
        "latency": latency_us(model, path, x, raw=raw),
    }
