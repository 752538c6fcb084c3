"""The MLflow pyfunc model `batchlab export` logs as `predictor`: raw feature rows in, the class name and
one probability per class out (`mlflow models serve`, `mlflow.pyfunc.load_model`).

MLflow's ONNX flavor returns the (N, classes) logits flattened into one column and needs scaled
inputs; this model applies the train split's scaler and a softmax. It is logged as code (MLflow's
models-from-code): this file is copied into the model and run wherever it is served, so it imports
numpy, pandas, onnxruntime and mlflow only, never batchlab (batchlab/inference/predict.py is its twin for files).

Inference parameter `output`: "all" (default) or "class", the predicted column alone, which is what
`mlflow.models.evaluate(model_type="classifier")` takes.
"""

from __future__ import annotations

import json
from typing import Any

import mlflow
import numpy as np
import pandas as pd
from mlflow.pyfunc import PythonModel

METADATA_KEY = "batchlab.preprocessing"  # batchlab.inference.predict.METADATA_KEY: the ONNX file's metadata entry


class OnnxPredictor(PythonModel):
    def load_context(self, context: Any) -> None:
        import onnxruntime as ort

        self.session = ort.InferenceSession(context.artifacts["onnx"], providers=["CPUExecutionProvider"])
        prep = json.loads(self.session.get_modelmeta().custom_metadata_map[METADATA_KEY])
        self.features: list[str] = prep["feature_names"]
        self.classes = np.asarray(prep["class_names"], dtype=object)
        self.mean = np.asarray(prep["mean"], dtype=np.float64)
        self.std = np.asarray(prep["std"], dtype=np.float64)
        self.input_name = self.session.get_inputs()[0].name

    # pd.DataFrame: a type hint MLflow accepts without inferring a schema from it (the signature has one)
    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> Any:
        frame = pd.DataFrame(model_input)
        missing = [c for c in self.features if c not in frame.columns]
        if missing:
            raise ValueError(f"missing feature columns {missing}; the model takes {self.features}")
        raw = frame[self.features].to_numpy(dtype=np.float64)
        if not np.isfinite(raw).all():
            raise ValueError("features hold missing, NaN or infinite values")
        x = ((raw - self.mean) / self.std).astype(np.float32)  # the arithmetic of batchlab.data.build
        logits = self.session.run(None, {self.input_name: x})[0].astype(np.float64)
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        proba = e / e.sum(axis=1, keepdims=True)
        predicted = pd.Series(self.classes[proba.argmax(axis=1)], name="predicted")
        if (params or {}).get("output", "all") == "class":
            return predicted
        probabilities = pd.DataFrame(proba, columns=[f"proba_{c}" for c in self.classes])
        return pd.concat([predicted, probabilities], axis=1)


mlflow.models.set_model(OnnxPredictor())
