"""The `predictor` pyfunc model (tracking/onnx_predictor.py): logged by export, fetched by `batchlab predict`;
the signatures of the run's ONNX models."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from batchlab.data import DataError
from batchlab.tracking.backend import preflight
from batchlab.tracking.flavors import logging_into
from batchlab.tracking.record import download, run_models

PREDICTOR = "predictor"  # the logged model's name in the run
CODE = Path(__file__).with_name("onnx_predictor.py")
REGISTRY_DESCRIPTION = (
    "batchlab's trained classifier as a pyfunc (ONNX): raw examples in (feature rows by column name, as the "
    "signature lists them; images or token ids as an array of the signature's shape and dtype); the class "
    "(`predicted`) and one `proba_<class>` column per class out. Serve it with "
    "`mlflow models serve -m models:/<name>@champion`; `champion` is the version with the best test F1."
)
TAKES_TAG = "batchlab.predictor.takes"  # the run's tag: what its predictor takes, in a version's description
EXAMPLE_DTYPES = {"images": np.float64, "tokens": np.int64}  # raw pixels as data.build reads them; ids


def takes(kind: str, shape: tuple[int, ...]) -> str:
    """What a predictor of examples of `kind` and `shape` takes, in words."""
    if kind == "rows":
        return "Raw feature rows"
    dims = ", ".join(map(str, ("N", *shape)))
    return f"{'Raw images' if kind == 'images' else 'Token ids'} ({dims}) {np.dtype(EXAMPLE_DTYPES[kind]).name}"


def version_description(run_id: str) -> str:
    """A registered version's description: what it takes and gives, and where the torch model is."""
    import mlflow

    what = mlflow.MlflowClient().get_run(run_id).data.tags.get(TAKES_TAG, "Raw feature rows")
    return (
        f"{what} in, class and probabilities out (ONNX, preprocessing inside). Logged by run {run_id}; "
        f"its torch model (scaled float32 in, logits out) is runs:/{run_id}/torch_model."
    )


def log_predictor(run_id: str, onnx_path: Path, example_rows: np.ndarray) -> str:
    """Log the ONNX model as the `predictor` pyfunc into run `run_id` (MlflowTracker.log_predictor
    calls it); its model URI. `example_rows`: a few raw examples (rows, images or token ids), the
    input example: its shape and dtype are the signature's."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # logging loads the model back
    import mlflow
    from mlflow.models import infer_signature

    from batchlab.inference.predict import OnnxClassifier

    model = OnnxClassifier(onnx_path)
    kind = model.prep.kind
    # rows: a frame whose columns are the features; images and tokens: an array (a tensor signature)
    example = _frame(example_rows, model.prep.feature_names) if kind == "rows" else (
        np.asarray(example_rows, dtype=EXAMPLE_DTYPES[kind]))
    signature = infer_signature(example, model.frame(example_rows), params={"output": "all"})
    with logging_into(run_id):
        mlflow.set_tag(TAKES_TAG, takes(kind, model.prep.shape))
        info = mlflow.pyfunc.log_model(
            name=PREDICTOR,
            python_model=str(CODE),
            artifacts={"onnx": str(onnx_path)},
            signature=signature,
            input_example=example,
            pip_requirements=["onnxruntime", "numpy", "pandas", f"mlflow=={mlflow.__version__}"],
        )
    return str(info.model_uri)


def onnx_signature(path: Path) -> Any:
    """The ONNX graph's own signature (the `onnx_model` flavor's): its input, raw examples (float64;
    token ids int64: the graph scales them) with a dynamic batch axis (-1), and its logits."""
    import onnx
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    graph = onnx.load(str(path)).graph

    def spec(value: onnx.ValueInfoProto) -> TensorSpec:
        tensor = value.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor.shape.dim)
        return TensorSpec(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)), dims, value.name)

    return ModelSignature(Schema([spec(v) for v in graph.input]), Schema([spec(v) for v in graph.output]))


def _frame(rows: np.ndarray, columns: list[str]) -> object:
    import pandas as pd

    return pd.DataFrame(np.asarray(rows, dtype=np.float64), columns=columns)


@contextlib.contextmanager
def onnx_file(uri: str, tracking_uri: str | None) -> Iterator[Path]:
    """A local copy of the ONNX model an MLflow URI names, while the context lasts.

    An ONNX or predictor model is used as it is (the registry's versions are predictors); any other
    model of a batchlab run (its torch model, a version registered before 2026-12) stands for the
    predictor logged in the same run.
    """
    import mlflow
    from mlflow.exceptions import MlflowException

    if tracking_uri:
        preflight(tracking_uri)
        mlflow.set_tracking_uri(tracking_uri)
    try:
        info = mlflow.models.get_model_info(uri)
        if "onnx" not in info.flavors and info.name != PREDICTOR:
            uri = _predictor_of(info.run_id, uri)
        with tempfile.TemporaryDirectory(prefix="batchlab-predict-") as tmp:
            local = download(uri, tmp)
            found = sorted(local.rglob("*.onnx"))
            if not found:
                raise DataError(f"{uri} holds no ONNX file")
            yield found[0]
    except MlflowException as err:
        raise DataError(f"{uri}: {str(err.message).splitlines()[0]}") from None


def _predictor_of(run_id: str | None, uri: str) -> str:
    import mlflow

    client = mlflow.MlflowClient()
    if run_id is None:
        raise DataError(f"{uri} was not logged by a run; give the ONNX model's path or a runs:/ URI")
    found = run_models(client, run_id, PREDICTOR)
    if not found:
        raise DataError(f"{uri} is not an ONNX model and its run {run_id} has no {PREDICTOR!r} model; "
                        "run `batchlab export` for that run")
    return f"models:/{found[-1].model_id}"
