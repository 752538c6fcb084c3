"""export.quantize: an int8 model in models/int8/ (a DVC output), smaller and as accurate, or no int8 model and a
failed stage when it loses more test F1 than export.quantize_max_f1_drop."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow import MlflowClient
from sklearn.linear_model import LogisticRegression

from batchlab import data, stages
from batchlab.config import ModelConfig
from batchlab.inference.predict import OnnxClassifier
from batchlab.model import build_model, save_model
from batchlab.paths import Paths
from batchlab.tracking.base import FAILED_ATTEMPT
from tests.support import TINY, merge, run, set_params, tiny_config, write_params


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_int8_model_passes_the_gate_is_smaller_and_predicts_like_fp32(workdir: Path, mode: str) -> None:
    cfg = tiny_config(model={"hidden_sizes": [64, 64]}, export={"quantize": mode})
    stages.generate(cfg)
    stages.train(cfg)
    report = stages.export(cfg)["quantize"]
    assert report == json.loads((workdir / "reports/export.json").read_text())["quantize"]
    int8 = workdir / "models/int8/model.int8.onnx"
    assert report["file"] == "models/int8/model.int8.onnx" and int8.stat().st_size == report["int8_bytes"]
    assert report["int8_bytes"] < report["fp32_bytes"] / 1.5, report
    assert report["f1_drop"] <= 0.005 and report["f1_drop"] == pytest.approx(
        report["f1_macro_fp32"] - report["f1_macro_int8"]
    )
    assert set(report["latency_us"]) == {"fp32_batch1", "fp32_full", "int8_batch1", "int8_full"}
    # the int8 file carries the scaler too: `batchlab predict` takes it; it agrees with fp32 on the test split
    fp32, quantized = OnnxClassifier(workdir / "models/model.onnx"), OnnxClassifier(int8)
    assert quantized.prep == fp32.prep
    raw = data.load("data/prepared").test.x * np.asarray(fp32.prep.std) + np.asarray(fp32.prep.mean)
    agree = (quantized.predict_proba(raw).argmax(1) == fp32.predict_proba(raw).argmax(1)).mean()
    assert agree >= 0.97, agree


def _int8_breaking_model(dataset: data.Dataset) -> torch.nn.Module:
    """A linear model whose classes differ by small weights beside one large weight both classes share:
    exact in float, while int8's one scale per tensor (large / 127) rounds the small weights to 0."""
    fit = LogisticRegression().fit(dataset.train.x, dataset.train.y)
    model = build_model(ModelConfig(hidden_sizes=[]), dataset.n_features, 2)
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].weight[1] = torch.from_numpy(0.05 * fit.coef_[0]).float()
        model[0].weight[:, 0] += 100.0
        model[0].bias.copy_(torch.tensor([0.0, 0.05 * float(fit.intercept_[0])]))
    return model


@pytest.mark.integration
def test_an_int8_model_beyond_the_f1_drop_fails_export_and_leaves_no_int8_file(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    params = merge(TINY, {"export": {"quantize": "dynamic", "atol": 1e-3},
                          "tracking": {"enabled": True, "tracking_uri": store}})  # fmt: skip
    write_params(tmp_path, params)
    paths = Paths(root=tmp_path)
    stages.generate(tiny_config(**params), paths)
    run(["batchlab", "train"], tmp_path)  # a good tracked run, which export logs into
    dataset = data.load(paths.data)
    save_model(paths.model, _int8_breaking_model(dataset), ModelConfig(hidden_sizes=[]), dataset.n_features,
               dataset.class_names)  # fmt: skip
    int8 = tmp_path / "models/int8/model.int8.onnx"
    int8.parent.mkdir(parents=True)
    int8.write_bytes(b"an int8 model of an earlier run")

    proc = run(["batchlab", "export"], tmp_path, check=False)
    assert proc.returncode == 1, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert re.fullmatch(
        r"batchlab: error: the dynamic int8 model loses 0\.\d{4} test F1 \(macro: 0\.9\d{3} -> 0\.\d{4}\), more than "
        r"export\.quantize_max_f1_drop=0\.005; no int8 model written",
        line,
    ), proc.stderr
    assert not int8.exists() and not list(int8.parent.glob(".model.int8*"))  # no temporary either
    # the export attempt failed, not the trained run: it stays FINISHED, the failure is a tag on it
    run_id = json.loads((tmp_path / "reports/train.json").read_text())["run_id"]
    trained = MlflowClient(store).get_run(run_id)
    assert trained.info.status == "FINISHED", trained.info.status
    assert trained.data.tags[FAILED_ATTEMPT].startswith("QuantizationError: the dynamic int8 model loses ")

    params["export"]["quantize"] = "none"  # the fp32 model alone: it passes the parity gate
    write_params(tmp_path, params)
    run(["batchlab", "export"], tmp_path)
    assert "quantize" not in json.loads((tmp_path / "reports/export.json").read_text())
    assert not int8.exists()


@pytest.mark.integration
def test_the_int8_model_is_versioned_by_dvc_restored_by_checkout_and_verified(repo_copy: Path) -> None:
    set_params(repo_copy, "export", quantize="dynamic")
    run(["dvc", "repro", "export"], repo_copy)
    int8 = repo_copy / "models/int8/model.int8.onnx"
    made = int8.read_bytes()
    run(["git", "add", "-A"], repo_copy)
    run(["git", "commit", "-qm", "int8"], repo_copy)

    set_params(repo_copy, "export", quantize="none")
    run(["dvc", "repro", "export"], repo_copy)
    assert not int8.exists() and "quantize" not in json.loads((repo_copy / "reports/export.json").read_text())
    set_params(repo_copy, "export", quantize="dynamic")  # back: restored from the run-cache, int8 file and all
    proc = run(["dvc", "repro", "export"], repo_copy)
    assert "Stage 'export' is cached - skipping run, checking out outputs" in proc.stdout, proc.stdout
    assert int8.read_bytes() == made

    set_params(repo_copy, "export", quantize="none")
    run(["dvc", "repro", "export"], repo_copy)
    run(["git", "commit", "-qam", "fp32 only"], repo_copy)
    run(["git", "checkout", "-q", "HEAD~1"], repo_copy)
    run(["dvc", "checkout", "export"], repo_copy)
    assert int8.read_bytes() == made
    run(["git", "checkout", "-q", "-"], repo_copy)
    run(["dvc", "checkout", "export"], repo_copy)
    assert not int8.exists()  # no int8 file of another model stays

    run(["git", "checkout", "-q", "HEAD~1"], repo_copy)
    run(["dvc", "checkout", "export"], repo_copy)
    damaged = bytearray(made)
    damaged[100] ^= 0xFF
    int8.write_bytes(bytes(damaged))
    proc = run(["batchlab", "verify"], repo_copy, check=False)
    assert proc.returncode == 1 and "mismatch: models/int8/model.int8.onnx: md5 " in proc.stdout, proc.stdout
