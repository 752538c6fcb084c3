"""Your own model and data: the built-in CNN and transformer, a model.factory module under
usermodels/, and .npz arrays, through train, export, predict and the sweep; what goes wrong is one
line naming the key."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from batchlab import data, stages
from batchlab.inference.predict import OnnxClassifier
from batchlab.model import load_model
from tests.support import TINY, merge, run, set_params, tiny_config, write_params
from tests.support.models import BATCHNORM

IMAGES = {"data": {"source": "digits_images"}, "model": {"name": "cnn", "dropout": 0.1}}
TOKENS = {"data": {"source": "sequences", "samples": 900, "classes": 3}, "model": {"name": "transformer"}}


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["images", "tokens"])
def test_a_builtin_network_trains_exports_and_predicts_raw_examples_as_torch_does(workdir: Path, kind: str) -> None:
    cfg = tiny_config(**(IMAGES if kind == "images" else TOKENS))
    stages.generate(cfg)
    dataset = data.load("data/prepared")
    assert dataset.kind == kind and dataset.input_shape == ((1, 8, 8) if kind == "images" else (16,))
    stages.train(cfg)
    metrics = stages.evaluate(cfg)
    assert metrics["accuracy"] > 0.8, metrics  # it learned: digits, or which id occurs most
    report = stages.export(cfg)
    assert report["max_abs_diff"] < 1e-4
    # predict takes the raw examples (data/prepared/examples.npy): the scaler travels in the file
    model, _ = load_model("models/model.pt")
    with torch.no_grad():
        expected = model(torch.from_numpy(dataset.test.x[:20])).argmax(1).numpy()
    proc = run(["batchlab", "predict", "--model", "models/model.onnx", "--input", "data/prepared/examples.npy"],
               Path("."))  # fmt: skip
    predicted = [line.split(",")[0] for line in proc.stdout.splitlines()[1:]]
    assert predicted == [dataset.class_names[i] for i in expected]
    raw = np.load("data/prepared/examples.npy")
    proba = OnnxClassifier(Path("models/model.onnx")).predict_proba(raw)
    assert (proba.argmax(1) == expected).all()


def test_per_channel_scaling_uses_the_train_split_only_and_tokens_stay_ids() -> None:
    images, scaler = data.build(tiny_config(**IMAGES).data)
    train = images.train.x
    assert train.shape[1:] == (1, 8, 8) and len(scaler["mean"]) == 1
    assert abs(float(train.mean())) < 1e-5 and abs(float(train.std()) - 1) < 1e-4  # per channel, over pixels
    tokens, scaler = data.build(tiny_config(**TOKENS).data)
    assert scaler == {"mean": [0.0], "std": [1.0]} and tokens.vocab == 8
    assert set(np.unique(tokens.train.x)) <= set(map(float, range(8)))


def _npz(path: Path, **arrays: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)


@pytest.mark.integration
def test_npz_arrays_train_and_bad_ones_are_one_line(workdir: Path) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(300, 2, 6, 6)), rng.integers(0, 2, 300)
    x[y == 1, 0] += 1.5  # learnable
    raw = workdir / "data/raw/mine.npz"
    _npz(raw, x=x, y=y)
    params = merge(TINY, {"data": {"source": "npz", "npz_path": "data/raw/mine.npz"}, "model": {"name": "cnn"}})
    write_params(workdir, params)
    run(["batchlab", "generate"], workdir)
    assert data.load("data/prepared").input_shape == (2, 6, 6)
    for arrays, message in (
        ({"x": x}, "mine.npz has no array 'y'; it needs x (N, ...) and y (N labels), has ['x']"),
        ({"x": x[:, 0, 0, 0], "y": y}, None),  # (N,): one number is no example shape
        ({"x": np.where(np.arange(x.size).reshape(x.shape) == 77, np.nan, x), "y": y},
         "mine.npz: x holds NaN or infinite values (first in example 1); fix them first"),
        ({"x": x, "y": np.zeros(300)}, "mine.npz: y has a single class (0.0); need at least 2"),
    ):  # fmt: skip
        _npz(raw, **arrays)
        proc = run(["batchlab", "generate"], workdir, check=False)
        [line] = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and line.startswith("batchlab: error: mine.npz"), proc.stderr
        if message is not None:
            assert line == f"batchlab: error: {message}"
    params["data"]["npz_path"] = "/tmp/elsewhere.npz"
    write_params(workdir, params)
    proc = run(["batchlab", "validate"], workdir, check=False)
    assert proc.returncode == 2 and "data.npz_path must be a file under data/raw/" in proc.stderr


BAD_FACTORIES = {
    "usermodels.absent:build": "model.factory 'usermodels.absent:build': cannot import 'usermodels.absent': "
    "ModuleNotFoundError: No module named 'usermodels.absent'",
    "usermodels.bad:nothing": "model.factory 'usermodels.bad:nothing': usermodels/bad.py defines no 'nothing'",
    "usermodels.bad:raises": "model.factory 'usermodels.bad:raises' raised ValueError: width must be even",
    "usermodels.bad:not_a_module": "model.factory 'usermodels.bad:not_a_module' returned int, not a torch nn.Module",
    "usermodels.bad:wrong_shape": "model.factory 'usermodels.bad:wrong_shape': its model gives (2, 3) for a batch "
    "of 2; it must give logits of shape (batch, 2)",
    "usermodels.bad:fails": "model.factory 'usermodels.bad:fails': its model fails on a batch of shape (2, 8): "
    "RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x8 and 5x2)",
}
BAD = textwrap.dedent(
    """
    from torch import nn

    def raises(input_shape, n_classes):
        raise ValueError("width must be even")

    def not_a_module(input_shape, n_classes):
        return 3

    def wrong_shape(input_shape, n_classes):
        return nn.Linear(input_shape[0], 3)

    def fails(input_shape, n_classes):
        return nn.Linear(5, n_classes)
    """
)


@pytest.mark.parametrize(
    "factory",  # the static check needs no torch; the others build the model in a child process (~3 s)
    [f if f.endswith(":nothing") else pytest.param(f, marks=pytest.mark.integration) for f in sorted(BAD_FACTORIES)],
)
@pytest.mark.integration
def test_a_factory_that_cannot_give_a_model_stops_validate_in_one_line(workdir: Path, factory: str) -> None:
    (workdir / "usermodels").mkdir()
    (workdir / "usermodels/__init__.py").write_text("")
    (workdir / "usermodels/bad.py").write_text(BAD)
    write_params(workdir, merge(TINY, {"model": {"factory": factory}}))
    proc = run(["batchlab", "validate"], workdir, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"batchlab: error: {BAD_FACTORIES[factory]}"
    ], proc.stderr
    assert not (workdir / ".batchlab/params.ok").exists()


@pytest.mark.integration
def test_a_batchnorm_model_trains_and_says_why_it_has_no_noise_scale(workdir: Path) -> None:
    (workdir / "usermodels").mkdir()
    (workdir / "usermodels/__init__.py").write_text("")
    (workdir / "usermodels/normed.py").write_text(BATCHNORM)
    write_params(workdir, merge(TINY, {"model": {"factory": "usermodels.normed:build", "kwargs": {"width": 8}}}))
    run(["batchlab", "generate"], workdir)
    proc = run(["batchlab", "train"], workdir)
    assert "gns: not measured for a model with BatchNorm1d (a row's gradient depends on its batch's statistics)" in (
        proc.stderr
    ), proc.stderr
    history = (workdir / "reports/history.csv").read_text().splitlines()
    assert "gns." not in history[0] and len(history) == 5
    proc = run(["batchlab", "noise-scale"], workdir, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "batchlab: error: models/model.pt: no noise scale for a model with BatchNorm1d (a row's gradient depends "
        "on its batch's statistics)"
    ]


@pytest.mark.integration
def test_a_users_module_under_ddp_and_fsdp_units_ends_as_one_process(repo_copy: Path) -> None:
    """usermodels/residual.py (no dropout, GroupNorm): 2 ranks of DDP, and FSDP sharding each residual
    Block (train.fsdp_units), end within 1e-5 of one process; a class the model lacks is one line."""
    from tests.support.ranks import DDP, max_diff, trained_weights

    set_params(repo_copy, "data", source="digits_images")
    set_params(repo_copy, "model", factory="usermodels.residual:build", kwargs={"width": 8})
    set_params(repo_copy, "train", epochs=2)
    run(["batchlab", "generate"], repo_copy)
    run(["batchlab", "train"], repo_copy)
    single = trained_weights(repo_copy)
    set_params(repo_copy, "train", **DDP)
    run(["batchlab", "train"], repo_copy)
    assert max_diff(single, trained_weights(repo_copy)) < 1e-5
    set_params(repo_copy, "train", strategy="fsdp", fsdp_units=["Block"])
    run(["batchlab", "train"], repo_copy)
    assert max_diff(single, trained_weights(repo_copy)) < 1e-5
    set_params(repo_copy, "train", fsdp_units=["Bottleneck"])
    proc = run(["batchlab", "train"], repo_copy, check=False)
    assert (
        proc.returncode != 0
        and "train.fsdp_units ['Bottleneck']: the model has no module of those classes; "
        "it has ['Block', 'Conv2d', 'GroupNorm', 'Linear', 'ResidualCNN', 'Sequential']"
        in proc.stderr
    ), proc.stderr
