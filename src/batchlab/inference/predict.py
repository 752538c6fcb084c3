"""`batchlab predict`: raw feature rows in, class and probabilities out, through onnxruntime only.

The ONNX graph takes raw examples and scales them itself (inference/export.py); its metadata names
the feature columns, the example shape and the classes, so a model file alone is enough to predict.
No torch import here.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from batchlab import atomic
from batchlab.data import DataError
from batchlab.inference.readers import CHUNK_ROWS, PREDICTED, proba_column, read_chunks

METADATA_KEY = "batchlab.preprocessing"  # the ONNX metadata_props entry; tracking/onnx_predictor.py reads it too


@dataclass(frozen=True)
class Preprocessing:
    """What a raw row needs before the network: its columns in order, the train split's scaler, and the
    names of the network's outputs."""

    feature_names: list[str]  # rows; images and tokens have none
    class_names: list[str]
    mean: list[float]  # per feature (rows), per channel (images); [0] for tokens
    std: list[float]
    kind: str = "rows"  # rows | images | tokens
    input_shape: list[int] | None = None  # one example's (None: rows of len(feature_names), as before)
    vocab: int = 0  # tokens: the ids the network embeds, 0 .. vocab-1 (0: unknown, an older file)

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_dataset_json(cls, path: Path) -> Preprocessing:
        """From data/prepared/dataset.json, which `batchlab generate` writes with the scaler."""
        meta = json.loads(path.read_text())
        if "scaler" not in meta:
            raise DataError(f"{path} holds no scaler; run `batchlab generate` (or `dvc repro generate`)")
        shape = meta.get("input_shape", [len(meta["feature_names"])])
        return cls(meta["feature_names"], meta["class_names"], meta["scaler"]["mean"], meta["scaler"]["std"],
                   meta.get("kind", "rows"), shape, int(meta.get("vocab", 0)))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.input_shape) if self.input_shape is not None else (len(self.feature_names),)

    @property
    def raw_dtype(self) -> Any:
        """What the exported graph takes: token ids as int64, rows and images as float64."""
        return np.int64 if self.kind == "tokens" else np.float64

    def network_input(self, raw: np.ndarray) -> np.ndarray:
        """Raw examples as the network takes them (float32), in data.build's arithmetic: float64
        (x - mean) / std per feature or per channel, then float32; token ids unscaled. The exported
        graph does the same (export.RawInput); the parity gate compares the two."""
        if self.kind == "tokens":
            return np.asarray(raw).astype(np.float32)
        per = (1, -1, *([1] * (len(self.shape) - 1))) if self.kind == "images" else (1, -1)
        mean, std = np.asarray(self.mean).reshape(per), np.asarray(self.std).reshape(per)
        return ((np.asarray(raw, dtype=np.float64) - mean) / std).astype(np.float32)


def attach_preprocessing(onnx_path: Path, prep: Preprocessing) -> None:
    """Store `prep` in the ONNX file's metadata (rewritten atomically); the graph is unchanged."""
    import onnx

    model = onnx.load(str(onnx_path))
    kept = [p for p in model.metadata_props if p.key != METADATA_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key=METADATA_KEY, value=prep.to_json())
    atomic.write_with(onnx_path, lambda tmp: onnx.save(model, str(tmp)))


class OnnxClassifier:
    """An ONNX model with its preprocessing: raw float rows -> class probabilities."""

    def __init__(self, path: Path) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1  # one core per process; big files are streamed, not parallelised
        try:
            self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as err:  # onnxruntime raises its own types, with multi-line text
            raise DataError(f"{path} is not an ONNX model onnxruntime can load: {str(err).splitlines()[0]}") from None
        raw = self.session.get_modelmeta().custom_metadata_map.get(METADATA_KEY)
        if raw is None:
            raise DataError(f"{path} holds no batchlab preprocessing (scaler, features, classes); re-export it: "
                            "`batchlab export` (or `dvc repro export`)")
        self.prep = Preprocessing(**json.loads(raw))
        self.input_name = self.session.get_inputs()[0].name
        shape = tuple(self.session.get_inputs()[0].shape[1:])
        if shape != self.prep.shape or (self.prep.kind == "rows" and shape != (len(self.prep.feature_names),)):
            rows = self.prep.kind == "rows" and len(shape) == 1
            took = f"{shape[0]} features" if rows else f"examples of shape {shape}"
            named = f"names {len(self.prep.feature_names)}" if rows else f"says {self.prep.shape}"
            raise DataError(f"{path} takes {took} but its record {named}; re-export it")
        takes = self.session.get_inputs()[0].type  # e.g. tensor(double)
        if takes != ("tensor(int64)" if self.prep.kind == "tokens" else "tensor(double)"):
            raise DataError(f"{path} takes {takes}, scaled examples (exported before the scaler moved into the "
                            "graph); re-export it: `batchlab export` (or `dvc repro export`)")

    @property
    def n_features(self) -> int:
        return len(self.prep.feature_names)

    @property
    def tabular(self) -> bool:
        """Rows with named columns: CSV and Parquet in, other columns passed through."""
        return self.prep.kind == "rows"

    def predict_proba(self, raw: np.ndarray) -> np.ndarray:
        # the graph scales (readers checked token ids are whole and in the vocab: int64 is exact). A value
        # too large for float32 gives non-finite probabilities, which _write refuses (no warning first)
        x = np.asarray(raw, dtype=self.prep.raw_dtype)
        with np.errstate(over="ignore", invalid="ignore"):
            logits = self.session.run(None, {self.input_name: x})[0].astype(np.float64)
            e = np.exp(logits - logits.max(axis=1, keepdims=True))
            return e / e.sum(axis=1, keepdims=True)

    def frame(self, raw: np.ndarray) -> Any:
        """The output columns of `raw`'s rows: predicted class name, then one probability per class."""
        import pandas as pd

        proba = self.predict_proba(raw)
        names = np.asarray(self.prep.class_names, dtype=object)
        columns = {PREDICTED: names[proba.argmax(axis=1)]}
        columns |= {proba_column(c): proba[:, i] for i, c in enumerate(self.prep.class_names)}
        return pd.DataFrame(columns)


def _write(model: OnnxClassifier, chunks: Iterator[tuple[np.ndarray, Any]], out: IO[str], name: str) -> int:
    import pandas as pd

    rows, header = 0, True
    for x, passed in chunks:
        frame = model.frame(x)
        finite = np.isfinite(frame.iloc[:, 1:].to_numpy(dtype=np.float64)).all(axis=1)
        if not finite.all():
            raise DataError(f"{name}: values in row {rows + int(np.argmin(finite)) + 1} are too large for the model "
                            "(its float32 output overflows); rescale or drop that row")
        if passed is not None:
            frame = pd.concat([passed.reset_index(drop=True), frame], axis=1)
        frame.to_csv(out, index=False, header=header)  # a header-only input gets the header alone
        rows, header = rows + len(frame), False
    if header:  # no chunk at all (an empty .npy): the output's header
        pd.DataFrame(columns=model.frame(np.zeros((0, *model.prep.shape))).columns).to_csv(out, index=False)
    return rows


def _write_stdout(model: OnnxClassifier, chunks: Iterator[tuple[np.ndarray, Any]], name: str) -> int:
    """Predict into an unnamed temporary file, then copy it to stdout: a bad row anywhere (or any other
    failure) prints nothing, and memory stays one chunk, the rest on disk in $TMPDIR. One pass over the
    input: checking it all first parses it twice (100k CSV rows: 1.01 s, against 0.85 s for this)."""
    stdout = sys.stdout
    # O_TMPFILE on Linux: the file never has a name, so even a SIGKILL leaves nothing behind
    with tempfile.TemporaryFile("w+", encoding=stdout.encoding, errors=stdout.errors, newline="") as spool:
        rows = _write(model, chunks, spool, name)
        spool.flush()
        spool.seek(0)
        stdout.flush()
        shutil.copyfileobj(spool.buffer, stdout.buffer, 1 << 20)
        stdout.buffer.flush()
    return rows


def predict_file(model: OnnxClassifier, source: Path, output: Path | None, chunk_rows: int = CHUNK_ROWS) -> int:
    """Predict every row of `source` into `output` (stdout when None), one chunk in memory at a time.
    Either gets all the rows or none (stdout: but for a kill during the final copy). Returns the row count."""
    chunks = read_chunks(source, model, chunk_rows)
    if output is None:
        return _write_stdout(model, chunks, source.name)
    with atomic.atomic_path(output) as tmp, tmp.open("w", newline="") as out:
        return _write(model, chunks, out, source.name)


def is_mlflow_uri(ref: str) -> bool:
    return ref.startswith(("models:/", "runs:/")) or "://" in ref


def load(ref: str) -> OnnxClassifier:
    """The ONNX model at `ref` (the CLI fetches an MLflow model URI's file first: tracking.pyfunc.onnx_file)."""
    path = Path(ref)
    if not path.is_file():
        raise DataError(f"no model at {ref!r} (an ONNX file such as models/model.onnx, or an MLflow model URI)")
    return OnnxClassifier(path)
