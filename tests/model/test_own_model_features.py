"""Issue #27's features on the networks that are not the MLP: the CNN on the digits as images, the
transformer on token sequences and a model.factory (usermodels/residual.py). Resume bit for bit, bf16
and accumulation, fp16 under its loss scale, a DDP rank restart, the MLflow predictor (signature,
registry, pyfunc predict), and token ids from an .npz."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from batchlab import data, stages
from batchlab.config import ConfigError, load_config
from batchlab.data import SPLITS, DataError, Dataset, Split
from batchlab.model import build_model
from batchlab.training.strategy import Strategy
from batchlab.training.train import fit
from tests.support import REPO, TINY, merge, run, set_params, tiny_config, write_params
from tests.support.fits import StopAfter
from tests.support.models import IMAGES, TOKENS

CPU = Strategy(torch.device("cpu"))
FACTORY = {  # GroupNorm and a global average: slower to learn the digits than the CNN at lr 0.01
    "data": {"source": "digits_images"},
    "model": {"factory": "usermodels.residual:build", "kwargs": {"width": 8}},
    "train": {"lr": 0.05},
}
MODELS: dict[str, dict[str, dict[str, Any]]] = {"cnn": IMAGES, "transformer": TOKENS, "factory": FACTORY}


@functools.cache
def _dataset(kind: str) -> Dataset:
    return data.build(tiny_config(**MODELS[kind]).data)[0]


def _config(kind: str, **train: Any) -> Any:
    """The tiny config of `kind`'s network, with these train keys (and model keys under `model`)."""
    model = train.pop("model", {})
    return tiny_config(**merge(MODELS[kind], {"train": train, "model": model}))


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    wa, wb = _weights(a), _weights(b)
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def _in_float64(dataset: Dataset) -> Dataset:
    """The same examples as float64 arrays (token ids stay whole numbers): with torch's default dtype
    float64 too, the model trains in float64."""
    splits = {name: Split(getattr(dataset, name).x.astype(np.float64), getattr(dataset, name).y) for name in SPLITS}
    return dataclasses.replace(dataset, **splits)


@contextlib.contextmanager
def float64_default() -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _test_accuracy(model: torch.nn.Module, dataset: Dataset) -> float:
    with torch.no_grad():
        predicted = model.eval()(torch.from_numpy(dataset.test.x)).argmax(1).numpy()
    return float((predicted == dataset.test.y).mean())


class Seen:
    """A tracker that keeps the epochs this process trained."""

    run_id = None

    def __init__(self) -> None:
        self.steps: list[int] = []

    def log_epoch(self, metrics: Mapping[str, float], step: int) -> None:
        self.steps.append(step)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """These fits run in this process: with torch's default (every core) its threads spun against the
    busy cores of a loaded machine, ~10x slower than one thread here (../shared/PITFALLS.md, torch)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def at_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    """model.factory imports usermodels/ from the working directory, as the stages do."""
    monkeypatch.chdir(REPO)


@pytest.mark.parametrize("kind", MODELS)
def test_resume_after_an_interruption_ends_with_the_same_weights_bit_for_bit(
    kind: str, tmp_path: Path, at_repo: None
) -> None:
    cfg, dataset = _config(kind, epochs=4, schedule="cosine"), _dataset(kind)
    expected = fit(cfg, dataset, CPU)
    checkpoint = tmp_path / "ckpt.pt"
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C in epoch 3, after epoch 2's checkpoint
        fit(cfg, dataset, CPU, tracker=StopAfter(2), checkpoint=checkpoint)  # type: ignore[arg-type]
    assert torch.load(checkpoint, weights_only=True)["state"]["epoch"] == 2
    seen = Seen()
    resumed = fit(cfg, dataset, CPU, tracker=seen, checkpoint=checkpoint)  # type: ignore[arg-type]
    assert seen.steps == [3, 4]  # it went on from the checkpoint (a fresh start ends equal too)
    assert [r["epoch"] for r in resumed.history] == [1, 2, 3, 4]
    want, got = _weights(expected.model), _weights(resumed.model)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert resumed.history[-1]["val_loss"] == expected.history[-1]["val_loss"]


@pytest.mark.parametrize("kind", MODELS)
def test_bf16_trains_to_fp32s_test_accuracy(kind: str, at_repo: None) -> None:
    dataset = _dataset(kind)
    fp32 = fit(_config(kind, epochs=4), dataset, CPU)
    bf16 = fit(_config(kind, epochs=4, precision="bf16"), dataset, Strategy(torch.device("cpu"), precision="bf16"))
    assert _max_diff(fp32.model, bf16.model) > 1e-4  # it really ran in bf16
    assert _test_accuracy(fp32.model, dataset) > 0.8
    assert abs(_test_accuracy(bf16.model, dataset) - _test_accuracy(fp32.model, dataset)) <= 0.03
    assert bf16.history[-1]["val_loss"] == pytest.approx(fp32.history[-1]["val_loss"], rel=0.1)


@pytest.mark.parametrize("kind", MODELS)
def test_accumulation_equals_the_big_batch_in_float64(kind: str, at_repo: None) -> None:
    """4 micro-batches of 8 make the same steps as one batch of 32: true in exact arithmetic, so it is
    checked in float64. In float32 the two sum a batch's gradient in another order, and Adam turns the
    ~1e-7 difference on a parameter whose gradient is zero in exact arithmetic (attention's key bias:
    softmax ignores a constant on every key) into steps of about +-lr: 4e-3 apart after 2 epochs here,
    2.2e-3 on another CPU after leaving that bias out. In float64 they agree to 7e-12 (transformer),
    6e-15 (factory), 3e-16 (CNN), every parameter included; Adam's eps (1e-8) dwarfs rounding there.
    No dropout: its masks depend on how the batch is cut."""
    dataset = _in_float64(_dataset(kind))
    with float64_default():
        one = fit(_config(kind, epochs=2, model={"dropout": 0.0}), dataset, CPU).model
        cfg = _config(kind, epochs=2, grad_accum_steps=4, model={"dropout": 0.0})
        accumulated = fit(cfg, dataset, Strategy(torch.device("cpu"), grad_accum_steps=4)).model
    want, got = _weights(one), _weights(accumulated)
    assert all(w.dtype == torch.float64 for w in want.values())
    assert max((want[k] - got[k]).abs().max().item() for k in want) < 1e-9
    x = torch.from_numpy(dataset.test.x)
    with torch.no_grad():
        torch.testing.assert_close(accumulated.eval()(x), one.eval()(x), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", MODELS)
def test_fp16_under_its_loss_scale_trains_to_fp32s_accuracy_and_reads_the_noise_scale_unscaled(
    kind: str, at_repo: None
) -> None:
    dataset, probed = _dataset(kind), {"epochs": 4, "gns_every": 10}
    fp32 = fit(_config(kind, **probed), dataset, CPU)
    fp16 = fit(_config(kind, precision="fp16", **probed), dataset, Strategy(torch.device("cpu"), precision="fp16"))
    assert _max_diff(fp32.model, fp16.model) > 1e-4  # it really ran in fp16
    assert abs(_test_accuracy(fp16.model, dataset) - _test_accuracy(fp32.model, dataset)) <= 0.03
    for key in ("gns.grad_sq", "gns.trace_sigma"):  # the loss scale (65536) squared would make them ~4e9x
        ratio = _geometric_mean(fp16.history, key) / _geometric_mean(fp32.history, key)
        assert 1 / 4 < ratio < 4, (key, ratio)


def _geometric_mean(history: list[dict[str, Any]], key: str) -> float:
    """A reading over the run's epochs. fp16 trains to other weights than fp32, and one reading of |G|²
    near the end follows them: the factory's last reading was 0.83-2.42x fp32's over 5 seeds here
    (0.41x on another CPU), one epoch's up to 8.3x; the geometric mean of the 4 epochs' readings was
    0.67-1.46x (CNN 0.88-0.98x, transformer 0.99-1.00x; tr(Σ) 0.85-1.07x). The bound, 4x either way,
    is 2.7x beyond that spread and 9 decades short of the fault it guards (the loss scale squared)."""
    return float(np.exp(np.mean([np.log(row[key]) for row in history])))


@pytest.mark.e2e
def test_a_killed_cnn_rank_is_restarted_and_resumes_to_the_same_weights(repo_copy: Path) -> None:
    from tests.support.ranks import DDP, killed_rank_resumes_to_the_same_weights

    set_params(repo_copy, "data", source="digits_images")
    set_params(repo_copy, "model", name="cnn", channels=[4, 8], dropout=0.1)
    set_params(repo_copy, "train", **DDP, epochs=20, batch_size=16, max_restarts=1)
    killed_rank_resumes_to_the_same_weights(repo_copy)


PIPELINES = {
    "images": (IMAGES, "float64", (-1, 1, 8, 8), "Raw images (N, 1, 8, 8) float64"),
    "tokens": (TOKENS, "int64", (-1, 16), "Token ids (N, 16) int64"),
}


@pytest.mark.integration
@pytest.mark.parametrize("kind", PIPELINES)
def test_the_mlflow_predictor_of_images_and_tokens_has_their_shape_registers_and_predicts_as_predict_does(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    import mlflow

    params, dtype, shape, takes = PIPELINES[kind]
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    tracked = {"tracking": {"enabled": True, "tracking_uri": uri, "registered_model": f"batchlab-{kind}"}}
    write_params(workdir, merge(merge(TINY, params), tracked))
    for stage in ("generate", "train", "evaluate", "export"):
        run(["batchlab", stage], workdir)
    run_id = json.loads((workdir / "reports/train.json").read_text())["run_id"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # undone after the test (set_tracking_uri exports it)
    mlflow.set_tracking_uri(uri)

    n_classes = len(json.loads((workdir / "data/prepared/dataset.json").read_text())["class_names"])
    signature = mlflow.models.get_model_info(f"runs:/{run_id}/predictor").signature
    [spec] = signature.inputs.inputs
    assert (spec.type, spec.shape) == (np.dtype(dtype), shape)
    assert signature.outputs.input_names() == ["predicted", *(f"proba_{c}" for c in range(n_classes))]
    graph = mlflow.models.get_model_info(f"runs:/{run_id}/onnx_model").signature  # the graph's own: raw, it scales
    [features], [logits] = graph.inputs.inputs, graph.outputs.inputs
    assert (features.name, features.type, features.shape) == ("features", np.dtype(dtype), shape)
    assert (logits.name, logits.shape) == ("logits", (-1, n_classes))

    version = mlflow.MlflowClient().get_model_version_by_alias(f"batchlab-{kind}", "champion")
    assert str(version.version) == "1" and version.description.startswith(f"{takes} in, class and probabilities out")
    examples = np.load(workdir / "data/prepared/examples.npy")
    assert examples.dtype == np.dtype(dtype) and examples.shape == (20, *shape[1:])
    answer = mlflow.pyfunc.load_model(f"models:/batchlab-{kind}@champion").predict(examples)
    run(["batchlab", "predict", "--model", "models/model.onnx", "--input", "data/prepared/examples.npy", "--output",
         "local.csv"], workdir)  # fmt: skip
    expected = pd.read_csv(workdir / "local.csv", dtype={"predicted": str}, float_precision="round_trip")
    pd.testing.assert_frame_equal(answer, expected, check_dtype=False)  # the same classes and probabilities
    fetched = run(["batchlab", "predict", "--model", f"models:/batchlab-{kind}@champion", "--input",
                   "data/prepared/examples.npy"], workdir)  # fmt: skip
    assert fetched.stdout == (workdir / "local.csv").read_text()
    with pytest.raises(mlflow.exceptions.MlflowException, match=f"does not match expected dtype {dtype}"):
        mlflow.pyfunc.load_model(f"models:/batchlab-{kind}@champion").predict(examples.astype(np.float32))


def _save(path: Path, **arrays: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)


def _ids(n: int = 400, length: int = 12, vocab: int = 6) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and a label a transformer learns: whether id 0 occurs more often than id 1."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, size=(n, length))
    return x, ((x == 0).sum(1) > (x == 1).sum(1)).astype(np.int64)


NPZ_TOKENS = {"data": {"source": "npz", "npz_path": "data/raw/ids.npz"},
              "model": {"name": "transformer", "d_model": 16, "heads": 2, "layers": 1}}  # fmt: skip


@pytest.mark.integration
def test_npz_token_ids_stay_ids_train_the_transformer_and_predict_refuses_ids_outside_the_vocab(
    workdir: Path,
) -> None:
    x, y = _ids()
    _save(workdir / "data/raw/ids.npz", x=x, y=y, vocab=np.int64(6))
    write_params(workdir, merge(merge(TINY, NPZ_TOKENS), {"train": {"epochs": 8}}))
    run(["batchlab", "validate"], workdir)
    cfg = load_config(workdir / "params.yaml")
    stages.generate(cfg)
    dataset = data.load("data/prepared")
    assert (dataset.kind, dataset.vocab, dataset.input_shape) == ("tokens", 6, (12,))
    # not scaled: the prepared rows of the three splits are x's rows, as they were
    prepared = np.concatenate([dataset.train.x, dataset.val.x, dataset.test.x])
    assert sorted(map(tuple, prepared.astype(np.int64).tolist())) == sorted(map(tuple, x.tolist()))
    assert (prepared == prepared.astype(np.int64)).all()
    stages.train(cfg)
    assert stages.evaluate(cfg)["accuracy"] > 0.8
    stages.export(cfg)
    examples = np.load("data/prepared/examples.npy")
    assert examples.dtype == np.int64 and examples.shape == (20, 12)
    proc = run(["batchlab", "predict", "--model", "models/model.onnx", "--input", "data/prepared/examples.npy"],
               workdir)  # fmt: skip
    assert len(proc.stdout.splitlines()) == 21
    for value, said in ((6, "6"), (-1, "-1"), (2.5, "2.5")):
        bad = examples.astype(np.float64)
        bad[3, 7] = value
        np.save(workdir / "bad.npy", bad)
        proc = run(["batchlab", "predict", "--model", "models/model.onnx", "--input", "bad.npy"], workdir, check=False)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
            f"batchlab: error: bad.npy: example 4 holds {said} at position 7, not a token id (0 .. 5)"
        ], proc.stderr


BAD_TOKENS = {
    "float ids": ({"x": _ids()[0].astype(np.float64)}, "ids.npz: x holds float64 values, but with a vocab it is "
                  "token ids: save it as integers (e.g. x.astype(np.int64))"),
    "an id past the vocab": ({"x": np.where(np.arange(4800).reshape(400, 12) == 41, 6, _ids()[0])},
                             "ids.npz: x holds token id 6 (example 3, position 5), outside 0 .. vocab-1 = 0 .. 5"),
    "a negative id": ({"x": np.where(np.arange(4800).reshape(400, 12) == 13, -2, _ids()[0])},
                      "ids.npz: x holds token id -2 (example 1, position 1), outside 0 .. vocab-1 = 0 .. 5"),
    "images with a vocab": ({"x": _ids()[0].reshape(400, 2, 6)}, "ids.npz: x has shape (400, 2, 6) and y (400,); "
                            "token ids need x (N, T) and y (N,) with the same N, T at least 1"),
    "a vocab of one": ({"vocab": np.int64(1)},
                       "ids.npz: vocab must be between 2 and 16777216 (ids travel as float32), got 1"),
    "a float vocab": ({"vocab": np.float64(6)},
                      "ids.npz: vocab must be one integer (the number of token ids), got float64 of shape ()"),
    "a vocab array": ({"vocab": np.array([6, 6])},
                      "ids.npz: vocab must be one integer (the number of token ids), got int64 of shape (2,)"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_TOKENS)
def test_bad_npz_token_ids_are_one_line_naming_the_file(workdir: Path, case: str) -> None:
    x, y = _ids()
    arrays, message = BAD_TOKENS[case]
    _save(workdir / "data/raw/ids.npz", **{"x": x, "y": y, "vocab": np.int64(6), **arrays})
    with pytest.raises(DataError) as err:
        data.build(tiny_config(**NPZ_TOKENS).data)
    assert str(err.value) == message


@pytest.mark.integration
def test_generate_refuses_bad_token_ids_in_one_line_and_the_transformer_names_the_missing_vocab(
    workdir: Path,
) -> None:
    x, y = _ids()
    _save(workdir / "data/raw/ids.npz", x=x.astype(np.float32), y=y, vocab=np.int64(6))
    write_params(workdir, merge(TINY, NPZ_TOKENS))
    proc = run(["batchlab", "generate"], workdir, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "batchlab: error: ids.npz: x holds float32 values, but with a vocab it is token ids: save it as integers "
        "(e.g. x.astype(np.int64))"
    ], proc.stderr
    _save(workdir / "data/raw/ids.npz", x=x, y=y)  # no vocab: integer columns are rows, scaled per feature
    dataset = data.build(tiny_config(**NPZ_TOKENS).data)[0]
    assert dataset.kind == "rows" and abs(float(dataset.train.x.mean())) < 1e-5
    with pytest.raises(ConfigError) as err:
        build_model(tiny_config(**NPZ_TOKENS).model, dataset.input_shape, dataset.n_classes, dataset.vocab)
    assert str(err.value) == (
        "model.name transformer takes token sequences (data.source sequences, or an .npz with a vocab); the data's "
        "examples have shape (12,) and no vocabulary"
    )
