from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from batchlab.config import ModelConfig
from batchlab.inference import export
from batchlab.model import build_model


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    torch.manual_seed(0)
    model = build_model(ModelConfig(hidden_sizes=[16, 8], activation="gelu", dropout=0.1), 6, 3).eval()
    path = tmp_path_factory.mktemp("onnx") / "model.onnx"
    export.export_onnx(model, 6, path, opset=18)
    return model, path


def test_export_is_one_checked_file_with_dynamic_batch(exported: tuple[torch.nn.Module, Path]) -> None:
    _, path = exported
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.onnx"]  # no external data, no temporaries
    graph = onnx.load(str(path)).graph
    batch_dim = graph.input[0].type.tensor_type.shape.dim[0]
    assert batch_dim.dim_param and not batch_dim.dim_value
    assert graph.input[0].name == "features" and graph.output[0].name == "logits"


def test_parity_gate_passes_at_batches_1_7_and_all(exported: tuple[torch.nn.Module, Path]) -> None:
    model, path = exported
    x = np.random.default_rng(0).normal(size=(50, 6)).astype(np.float32)
    results = export.check_parity(model, path, x, atol=1e-4)
    assert [r.batch for r in results] == [1, 7, 50]
    assert all(r.max_abs_diff <= 1e-4 and r.mismatched_predictions == 0 for r in results)


def test_parity_gate_fails_with_the_figures_when_models_differ(exported: tuple[torch.nn.Module, Path]) -> None:
    model, path = exported
    changed = build_model(ModelConfig(hidden_sizes=[16, 8], activation="gelu"), 6, 3)
    changed.load_state_dict(model.state_dict())
    with torch.no_grad():
        changed[-1].bias += torch.tensor([0.0, 0.0, 0.01])
    x = np.random.default_rng(0).normal(size=(20, 6)).astype(np.float32)
    with pytest.raises(export.ParityError, match=r"batch 1: max \|diff\| 1\.00e-02"):
        export.check_parity(changed.eval(), path, x, atol=1e-4)


def test_latency_reports_both_engines(exported: tuple[torch.nn.Module, Path]) -> None:
    model, path = exported
    x = np.zeros((32, 6), dtype=np.float32)
    lat = export.latency_us(model, path, x, repeats=20)
    assert set(lat) == {f"{e}_{b}_us" for e in ("onnxruntime", "torch") for b in ("batch1", "full")}
    assert all(v > 0 for v in lat.values())


@pytest.mark.parametrize("activation", ["relu", "gelu", "tanh", "silu"])
@pytest.mark.parametrize("opset", [13, export.TORCHSCRIPT_MAX_OPSET])
def test_every_activation_passes_the_gate_through_the_torchscript_exporter(
    activation: str, opset: int, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(hidden_sizes=[16, 8], activation=activation), 6, 3).eval()
    export.export_onnx(model, 6, tmp_path / "model.onnx", opset=opset)
    x = np.random.default_rng(0).normal(size=(50, 6)).astype(np.float32)
    assert max(r.max_abs_diff for r in export.check_parity(model, tmp_path / "model.onnx", x, atol=1e-5)) <= 1e-5


# a fresh interpreter: what exporting one model loads
LOADED = """
import sys
import torch
from batchlab.inference import export
from batchlab.config import ModelConfig
from batchlab.model import build_model
export.export_onnx(build_model(ModelConfig(hidden_sizes=[8]), 4, 2), 4, sys.argv[2], opset=int(sys.argv[1]))
print(",".join(m for m in ("onnxscript", "torch._dynamo") if m in sys.modules))
"""


@pytest.mark.integration
def test_opsets_up_to_20_export_without_loading_the_dynamo_exporter(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", LOADED, "18", str(tmp_path / "model.onnx")], capture_output=True, text=True, check=True
    )
    assert proc.stdout.strip() == "", proc.stdout  # onnxscript + dynamo: ~1.2 s to import, ~2.7 s to export


@pytest.mark.integration
def test_opsets_above_20_export_through_dynamo_and_pass_the_gate(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(hidden_sizes=[16, 8], activation="gelu"), 6, 3).eval()
    export.export_onnx(model, 6, tmp_path / "model.onnx", opset=23)
    assert onnx.load(str(tmp_path / "model.onnx")).opset_import[0].version == 23
    x = np.random.default_rng(0).normal(size=(50, 6)).astype(np.float32)
    assert all(r.mismatched_predictions == 0 for r in export.check_parity(model, tmp_path / "model.onnx", x, 1e-4))
