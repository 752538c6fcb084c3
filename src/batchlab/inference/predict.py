"""`batchlab predict`: raw feature rows in, class and probabilities out, through onnxruntime only.

The ONNX model carries what turns raw rows into its input (feature names, the train split's scaler,
class names) in its metadata, so a model file alone is enough to predict. No torch import here.
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
from batchlab.data.sources import UNREADABLE_ARRAYS, unreadable_array

METADATA_KEY = "batchlab.preprocessing"  # the ONNX metadata_props entry; tracking/onnx_predictor.py reads it too
PREDICTED = "predicted"  # the class column, named as in reports/predictions.csv
CHUNK_ROWS = 65_536


def proba_column(class_name: str) -> str:
    return f"proba_{class_name}"


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
                   meta.get("kind", "rows"), shape)  # fmt: skip

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.input_shape) if self.input_shape is not None else (len(self.feature_names),)


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
                            "`batchlab export` (or `dvc repro export`)")  # fmt: skip
        self.prep = Preprocessing(**json.loads(raw))
        self.input_name = self.session.get_inputs()[0].name
        shape = tuple(self.session.get_inputs()[0].shape[1:])
        if shape != self.prep.shape or (self.prep.kind == "rows" and shape != (len(self.prep.feature_names),)):
            rows = self.prep.kind == "rows" and len(shape) == 1
            took = f"{shape[0]} features" if rows else f"examples of shape {shape}"
            named = f"names {len(self.prep.feature_names)}" if rows else f"says {self.prep.shape}"
            raise DataError(f"{path} takes {took} but its record {named}; re-export it")
        # broadcast over the examples: per feature, or per channel of (N, C, H, W)
        per = (-1, *([1] * (len(shape) - 1))) if self.prep.kind == "images" else (-1,)
        self.mean = np.asarray(self.prep.mean, dtype=np.float64).reshape(per)
        self.std = np.asarray(self.prep.std, dtype=np.float64).reshape(per)

    @property
    def n_features(self) -> int:
        return len(self.prep.feature_names)

    @property
    def tabular(self) -> bool:
        """Rows with named columns: CSV and Parquet in, other columns passed through."""
        return self.prep.kind == "rows"

    def predict_proba(self, raw: np.ndarray) -> np.ndarray:
        # the same arithmetic as data.build: float64 scaling, then float32. A value too large for float32
        # gives non-finite probabilities, which _write refuses (no warning printed first)
        with np.errstate(over="ignore", invalid="ignore"):
            x = ((np.asarray(raw, dtype=np.float64) - self.mean) / self.std).astype(np.float32)
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


def _check_finite(x: np.ndarray, columns: list[str], name: str, first_row: int) -> None:
    bad = ~np.isfinite(x)
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise DataError(f"{name}: missing, NaN or infinite value in column {columns[col]!r} (row {first_row + row}); "
                        "fill or drop those rows first")  # fmt: skip


def _table_chunks(frames: Iterator[Any], name: str, model: OnnxClassifier) -> Iterator[tuple[np.ndarray, Any]]:
    """Feature arrays and the other columns (passed through) of each chunk of a CSV or Parquet table."""
    import pandas as pd

    features = model.prep.feature_names
    taken = {PREDICTED, *(proba_column(c) for c in model.prep.class_names)}
    start = 1
    for frame in frames:
        missing = [c for c in features if c not in frame.columns]
        if missing:
            raise DataError(f"{name}: missing feature columns {missing}; the model takes {features}")
        clash = sorted(taken & set(map(str, frame.columns)))
        if clash:
            raise DataError(f"{name}: columns {clash} would be overwritten by the output; rename them")
        twice = sorted({c for c in features if int((frame.columns == c).sum()) > 1})
        if twice:
            raise DataError(f"{name}: feature columns {twice} appear more than once; keep one of each")
        for c in features:
            column = frame[c]
            # an empty column (a header-only input) has no dtype to check: it is numeric enough
            if len(column) and (pd.api.types.is_bool_dtype(column) or not pd.api.types.is_numeric_dtype(column)):
                wrong = (pd.to_numeric(column, errors="coerce").isna() & column.notna()).to_numpy()
                at = int(np.argmax(wrong))  # by position: a Parquet file's pandas index may be anything
                example = f" (row {start + at}: {column.iloc[at]!r})" if wrong.any() else f" ({column.dtype} values)"
                raise DataError(f"{name}: feature column {c!r} is not numeric{example}")
        x = frame[features].to_numpy(dtype=np.float64)
        _check_finite(x, features, name, start)
        yield x, frame.drop(columns=features)
        start += len(frame)


def read_chunks(path: Path, model: OnnxClassifier, chunk_rows: int = CHUNK_ROWS) -> Iterator[tuple[np.ndarray, Any]]:
    """(features, passed-through columns or None) per chunk of a CSV, Parquet or .npy file, checked."""
    if not path.is_file():
        raise DataError(f"input file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if not model.tabular and suffix in (".csv", ".parquet", ".pq"):
        raise DataError(f"{path.name}: this model takes {model.prep.kind} of shape {model.prep.shape}; give them as "
                        ".npy, or an .npz with an array x (rows, *that shape)")  # fmt: skip
    if suffix == ".csv":
        import pandas as pd

        malformed = (pd.errors.ParserError, UnicodeDecodeError)  # the header is parsed here, the rows per chunk
        try:  # round_trip: the exact float64 a CSV writer printed, as training read it
            reader = pd.read_csv(path, chunksize=chunk_rows, float_precision="round_trip")
        except pd.errors.EmptyDataError:
            raise DataError(f"{path.name} is empty; it needs a header row naming the feature columns") from None
        except malformed as err:
            raise _not_csv(path.name, err) from None
        with reader:
            try:
                yield from _table_chunks(iter(reader), path.name, model)
            except malformed as err:
                raise _not_csv(path.name, err) from None
    elif suffix in (".parquet", ".pq"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        damaged = (pa.ArrowException, OSError)  # the footer is read here, each page as its batch is
        try:
            parquet = pq.ParquetFile(path)
        except damaged as err:
            raise DataError(f"{path.name} is not a Parquet file: {_first_line(err)}") from None
        try:
            yield from _table_chunks(_frames(parquet, path.name, chunk_rows), path.name, model)
        except damaged as err:
            raise DataError(f"{path.name} is a damaged Parquet file: {_first_line(err)}") from None
    elif suffix in (".npy", ".npz"):
        yield from _array_chunks(path, model, chunk_rows)
    else:
        kinds = ".csv, .parquet or .npy" if model.tabular else ".npy or .npz (an array x)"
        raise DataError(f"{path.name}: input must be {kinds}")


def _frames(parquet: Any, name: str, chunk_rows: int) -> Iterator[Any]:
    """The Parquet file's row batches as DataFrames (a damaged page raises as it is read)."""
    import pyarrow as pa

    for batch in parquet.iter_batches(batch_size=chunk_rows):
        try:
            frame = batch.to_pandas()
        except (ValueError, TypeError, pa.ArrowException) as err:  # e.g. a dictionary column with NaN in it
            raise DataError(f"{name}: pandas cannot convert its columns ({_first_line(err)}); store the features "
                            "as plain numbers") from None  # fmt: skip
        yield frame


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _not_csv(name: str, err: BaseException) -> DataError:
    return DataError(f"{name} is not a valid UTF-8 CSV: {_first_line(err)}")


def _array_chunks(path: Path, model: OnnxClassifier, chunk_rows: int) -> Iterator[tuple[np.ndarray, Any]]:
    """Raw examples from an .npy array, or the array `x` of an .npz: (N, *the model's example shape)."""
    try:  # errstate: numpy warns of the overflow before it refuses a header's shape past 2**63 bytes
        if path.suffix.lower() == ".npz":
            with np.errstate(over="ignore"), np.load(path, allow_pickle=False) as arrays:
                if "x" not in arrays.files:
                    raise DataError(f"{path.name} has no array 'x' (it has {arrays.files})")
                array = arrays["x"]
        else:
            with np.errstate(over="ignore"):
                array = np.load(path, mmap_mode="r", allow_pickle=False)
    except UNREADABLE_ARRAYS as err:
        if isinstance(err, DataError):
            raise
        raise unreadable_array(path.name, f"a readable {path.suffix} array", err) from None
    shape = model.prep.shape
    if array.ndim != 1 + len(shape) or tuple(array.shape[1:]) != shape:
        order = f" features, in this order: {model.prep.feature_names}" if model.tabular else ""
        raise DataError(f"{path.name}: shape {array.shape}, but the model takes (rows, {', '.join(map(str, shape))})"
                        f"{order}")  # fmt: skip
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.number) or array.dtype.kind == "c":
        raise DataError(f"{path.name}: {array.dtype} values; features must be real numbers")
    for start in range(0, array.shape[0], chunk_rows):
        x = np.asarray(array[start : start + chunk_rows], dtype=np.float64)
        if model.tabular:
            _check_finite(x, model.prep.feature_names, path.name, start + 1)
        elif not (finite := np.isfinite(x.reshape(len(x), -1)).all(axis=1)).all():
            bad = start + int(np.argmin(finite)) + 1
            raise DataError(f"{path.name}: NaN or infinite values in example {bad}; fix or drop it first")
        yield x, None


def _write(model: OnnxClassifier, chunks: Iterator[tuple[np.ndarray, Any]], out: IO[str], name: str) -> int:
    import pandas as pd

    rows, header = 0, True
    for x, passed in chunks:
        frame = model.frame(x)
        finite = np.isfinite(frame.iloc[:, 1:].to_numpy(dtype=np.float64)).all(axis=1)
        if not finite.all():
            raise DataError(f"{name}: values in row {rows + int(np.argmin(finite)) + 1} are too large for the model "
                            "(its float32 output overflows); rescale or drop that row")  # fmt: skip
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
