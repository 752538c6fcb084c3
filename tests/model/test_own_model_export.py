"""Issue #27's export for the networks that are not the MLP: the ONNX graph of the CNN and the
transformer takes raw examples (images float64, per-channel scaler inside the graph; token ids int64),
so onnxruntime alone, fed the raw test split, gives `batchlab predict`'s and evaluate's answers; int8
for both behind the F1 gate; `batchlab verify` and `batchlab reproduce` on their runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pandas as pd
import pytest
import torch
from sklearn.model_selection import train_test_split

from batchlab import data
from batchlab.config import ExportConfig, load_config
from batchlab.inference import export, quantize
from batchlab.inference.predict import OnnxClassifier, Preprocessing
from tests.support import TINY, merge, run, set_params, write_params
from tests.support.models import IMAGES, TOKENS

KINDS = {"cnn": IMAGES, "transformer": TOKENS}
IMAGE_PREP = Preprocessing([], ["0", "1"], [3.0, -2.0], [0.5, 4.0], "images", [2, 3, 3])
TOKEN_PREP = Preprocessing([], ["0", "1"], [0.0], [1.0], "tokens", [5], vocab=7)


def _raw(prep: Preprocessing, n: int = 9) -> np.ndarray:
    rng = np.random.default_rng(0)
    if prep.kind == "tokens":
        return rng.integers(0, prep.vocab, size=(n, *prep.shape))
    return rng.normal(3.0, 10.0, size=(n, *prep.shape))


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("prep", [IMAGE_PREP, TOKEN_PREP], ids=["images", "tokens"])
def test_the_graph_preprocesses_raw_examples_bit_for_bit_as_data_build(prep: Preprocessing, tmp_path: Path) -> None:
    path = tmp_path / "identity.onnx"
    export.export_onnx(torch.nn.Flatten(), prep, path, opset=18)  # the network's input, flattened, comes out
    raw = _raw(prep)
    [features] = _session(path).get_inputs()
    assert features.type == ("tensor(int64)" if prep.kind == "tokens" else "tensor(double)")
    assert features.shape[1:] == list(prep.shape) and isinstance(features.shape[0], str)  # a dynamic batch
    scaled = _session(path).run(None, {"features": raw})[0]
    np.testing.assert_array_equal(scaled, prep.network_input(raw).reshape(len(raw), -1))
    if prep.kind == "images":  # per channel: channel 1's (x + 2) / 4
        np.testing.assert_array_equal(scaled[:, 9:], ((raw[:, 1] + 2.0) / 4.0).astype(np.float32).reshape(9, -1))


def test_the_parity_gate_fails_on_examples_scaled_twice(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 2), torch.nn.Flatten(), torch.nn.Linear(12, 2)).eval()
    raw = _raw(IMAGE_PREP, 20)
    report = export.export_checked(model, raw, IMAGE_PREP, tmp_path / "m.onnx", opset=18, atol=1e-5)
    assert report["max_abs_diff"] <= 1e-5
    x = IMAGE_PREP.network_input(raw)
    with pytest.raises(export.ParityError, match="predictions differ"):
        export.check_parity(model, tmp_path / "m.onnx", x, atol=1e-5, raw=x.astype(np.float64))  # scaled again


def raw_test_split(root: Path) -> np.ndarray:
    """The test split before scaling (data.build's split of the source's examples)."""
    split = load_config(root / "params.yaml").data
    raw = data.raw_table(split)
    _, x_test = train_test_split(raw.x, test_size=split.test_fraction, stratify=raw.y, random_state=split.seed)
    return np.asarray(x_test)


def _pipeline(root: Path, kind: str, quantize_mode: str) -> None:
    write_params(root, merge(merge(TINY, KINDS[kind]), {"export": {"quantize": quantize_mode}}))
    for stage in ("generate", "train", "evaluate", "export"):
        run(["batchlab", stage], root)


def _proba(session: ort.InferenceSession, x: np.ndarray) -> np.ndarray:
    logits = session.run(None, {"features": x})[0].astype(np.float64)
    e = np.exp(logits - logits.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


@pytest.mark.integration
@pytest.mark.parametrize("kind", KINDS)
def test_onnxruntime_alone_on_raw_examples_answers_as_predict_and_evaluate_and_int8_passes_the_gate(
    workdir: Path, kind: str
) -> None:
    _pipeline(workdir, kind, "dynamic")
    session = _session(workdir / "models/model.onnx")  # the file alone: no batchlab, no metadata read
    examples = np.load(workdir / "data/prepared/examples.npy")
    run(["batchlab", "predict", "--model", "models/model.onnx", "--input", "data/prepared/examples.npy", "--output",
         "out.csv"], workdir)  # fmt: skip
    out = pd.read_csv(workdir / "out.csv", dtype={"predicted": str}, float_precision="round_trip")
    proba = _proba(session, examples)  # as generate saved them: float64 pixels, int64 token ids
    np.testing.assert_array_equal(out.drop(columns="predicted").to_numpy(), proba)
    assert out["predicted"].tolist() == [str(c) for c in proba.argmax(1)]
    # the raw test split, straight from the source: the torch model's classes (evaluate's predictions.csv)
    raw = raw_test_split(workdir)
    expected = pd.read_csv(workdir / "reports/predictions.csv", dtype=str)["predicted"]
    dtype = np.int64 if kind == "transformer" else np.float64
    assert [str(c) for c in _proba(session, raw.astype(dtype)).argmax(1)] == expected.tolist()

    report: dict[str, Any] = json.loads((workdir / "reports/export.json").read_text())["quantize"]
    assert report["f1_drop"] <= report["max_f1_drop"] == 0.005
    int8 = workdir / "models/int8/model.int8.onnx"
    fp32, dynamic = OnnxClassifier(workdir / "models/model.onnx"), OnnxClassifier(int8)
    assert (dynamic.predict_proba(raw).argmax(1) == fp32.predict_proba(raw).argmax(1)).mean() >= 0.95
    # static (QDQ, calibrated on the raw train split) on the same model: the gate passes it too
    static = quantize.quantize_gated(workdir / "models/model.onnx", ExportConfig(quantize="static"),
                                     data.load(workdir / "data/prepared"))  # fmt: skip
    assert static is not None and static["f1_drop"] <= 0.005, static
    agree = (OnnxClassifier(int8).predict_proba(raw).argmax(1) == fp32.predict_proba(raw).argmax(1)).mean()
    assert agree >= 0.95, agree


@pytest.mark.integration
@pytest.mark.parametrize("kind", KINDS)
def test_verify_and_reproduce_work_unchanged_on_a_cnn_and_a_transformer_run(repo_copy: Path, kind: str) -> None:
    store = f"sqlite:///{repo_copy / 'mlflow.db'}"
    for section, values in merge(KINDS[kind], {"tracking": {"enabled": True, "tracking_uri": store}}).items():
        set_params(repo_copy, section, **values)
    run(["git", "commit", "-qam", f"a {kind} run"], repo_copy)
    (repo_copy / "dvc.lock").unlink()  # this run's stages only (the committed lock also records a sweep)
    run(["dvc", "repro", "evaluate", "export"], repo_copy)
    verified = run(["batchlab", "verify"], repo_copy)
    assert verified.stdout.strip().splitlines()[0].endswith("; all match"), verified.stdout
    run_id = json.loads((repo_copy / "reports/train.json").read_text())["run_id"]
    [verdict] = run(["batchlab", "reproduce", run_id], repo_copy).stdout.strip().splitlines()
    assert verdict.startswith(f"reproduce: run {run_id} at ") and ": identical (" in verdict, verdict
