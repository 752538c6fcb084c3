"""The `predictor` pyfunc model (tracking/onnx_predictor.py): logged by export, fetched by `batchlab predict`."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from batchlab.data import DataError
from batchlab.tracking.backend import preflight
from batchlab.tracking.flavors import logging_into
from batchlab.tracking.record import download, run_models

PREDICTOR = "predictor"  # the logged model's name in the run
CODE = Path(__file__).with_name("onnx_predictor.py")
REGISTRY_DESCRIPTION = (
    "batchlab's trained classifier as a pyfunc (ONNX): raw feature rows in, by column name (the signature "
    "lists them); the class (`predicted`) and one `proba_<class>` column per class out. Serve it with "
    "`mlflow models serve -m models:/<name>@champion`; `champion` is the version with the best test F1."
)


def version_description(run_id: str) -> str:
    """A registered version's description: what it takes and gives, and where the torch model is."""
    return (
        f"Raw feature rows in, class and probabilities out (ONNX, scaler inside). Logged by run {run_id}; "
        f"its torch model (scaled float32 in, logits out) is runs:/{run_id}/torch_model."
    )


def log_predictor(run_id: str, onnx_path: Path, example_rows: np.ndarray) -> str:
    """Log the ONNX model as the `predictor` pyfunc into run `run_id` (MlflowTracker.log_predictor
    calls it); its model URI. `example_rows`: a few raw feature rows, the input example."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # logging loads the model back
    import mlflow
    from mlflow.models import infer_signature

    from batchlab.inference.predict import OnnxClassifier

    model = OnnxClassifier(onnx_path)
    example = _frame(example_rows, model.prep.feature_names)
    signature = infer_signature(example, model.frame(example_rows), params={"output": "all"})
    with logging_into(run_id):
        info = mlflow.pyfunc.log_model(
            name=PREDICTOR,
            python_model=str(CODE),
            artifacts={"onnx": str(onnx_path)},
            signature=signature,
            input_example=example,
            pip_requirements=["onnxruntime", "numpy", "pandas", f"mlflow=={mlflow.__version__}"],
        )
    return str(info.model_uri)


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
                        "run `batchlab export` for that run")  # fmt: skip
    return f"models:/{found[-1].model_id}"
