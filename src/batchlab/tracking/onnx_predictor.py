"""The MLflow pyfunc model `batchlab export` logs as `predictor`: raw examples in (feature rows by column
name; images, an array (N, C, H, W) of float64; token ids, an array (N, T) of int64), the class name and
one probability per class out (`mlflow models serve`, `mlflow.pyfunc.load_model`).

MLflow's ONNX flavor returns the (N, classes) logits flattened into one column; this model checks
the input, hands it to the graph as it is (the graph holds the train split's scaler) and applies a
softmax. It is logged as code (MLflow's models-from-code): this file is copied into the model and run
wherever it is served, so it imports
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
        self.kind: str = prep.get("kind", "rows")
        self.features: list[str] = prep["feature_names"]
        self.shape = tuple(prep.get("input_shape") or [len(self.features)])
        self.vocab = int(prep.get("vocab", 0))
        self.classes = np.asarray(prep["class_names"], dtype=object)
        # what the graph takes, raw: token ids as int64, rows and images as float64 (it scales them itself)
        self.dtype = np.int64 if self.kind == "tokens" else np.float64
        self.input_name = self.session.get_inputs()[0].name

    def _raw(self, model_input: Any) -> np.ndarray:
        """The examples as float64: rows by column name, images and token ids as an array."""
        if self.kind == "rows":
            frame = pd.DataFrame(model_input)
            missing = [c for c in self.features if c not in frame.columns]
            if missing:
                raise ValueError(f"missing feature columns {missing}; the model takes {self.features}")
            raw = frame[self.features].to_numpy(dtype=np.float64)
        else:
            raw = np.asarray(model_input, dtype=np.float64)
            if raw.shape[1:] != self.shape:
                raise ValueError(
                    f"examples of shape {raw.shape[1:]}; the model takes {self.kind} of shape {self.shape}"
                )
        if not np.isfinite(raw).all():
            raise ValueError("the input holds missing, NaN or infinite values")
        if self.kind == "tokens" and ((raw != np.floor(raw)) | (raw < 0) | (raw >= (self.vocab or np.inf))).any():
            raise ValueError(f"token ids must be whole numbers 0 .. {self.vocab - 1}")
        return raw

    # pd.DataFrame: a type hint MLflow accepts without inferring a schema from it (the signature has one,
    # a tensor's for images and tokens: those arrive as numpy arrays)
    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> Any:
        raw = self._raw(model_input)
        logits = self.session.run(None, {self.input_name: raw.astype(self.dtype)})[0].astype(np.float64)
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        proba = e / e.sum(axis=1, keepdims=True)
        predicted = pd.Series(self.classes[proba.argmax(axis=1)], name="predicted")
        if (params or {}).get("output", "all") == "class":
            return predicted
        probabilities = pd.DataFrame(proba, columns=[f"proba_{c}" for c in self.classes])
        return pd.concat([predicted, probabilities], axis=1)


mlflow.models.set_model(OnnxPredictor())
