"""predict's input readers: raw rows from CSV or Parquet, raw examples from .npy/.npz, each chunk
checked (the model's columns or example shape, real finite numbers) before a line goes out; every
problem one line (DataError). No torch import here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from batchlab.data import DataError
from batchlab.data.sources import UNREADABLE_ARRAYS, unreadable_array

if TYPE_CHECKING:
    from batchlab.inference.predict import OnnxClassifier

PREDICTED = "predicted"  # the class column, named as in reports/predictions.csv
CHUNK_ROWS = 65_536


def proba_column(class_name: str) -> str:
    return f"proba_{class_name}"


def _check_finite(x: np.ndarray, columns: list[str], name: str, first_row: int) -> None:
    bad = ~np.isfinite(x)
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise DataError(f"{name}: missing, NaN or infinite value in column {columns[col]!r} (row {first_row + row}); "
                        "fill or drop those rows first")


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
                        ".npy, or an .npz with an array x (rows, *that shape)")
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
                            "as plain numbers") from None
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
                        f"{order}")
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.number) or array.dtype.kind == "c":
        raise DataError(f"{path.name}: {array.dtype} values; features must be real numbers")
    for start in range(0, array.shape[0], chunk_rows):
        x = np.asarray(array[start : start + chunk_rows], dtype=np.float64)
        if model.tabular:
            _check_finite(x, model.prep.feature_names, path.name, start + 1)
        elif not (finite := np.isfinite(x.reshape(len(x), -1)).all(axis=1)).all():
            bad = start + int(np.argmin(finite)) + 1
            raise DataError(f"{path.name}: NaN or infinite values in example {bad}; fix or drop it first")
        if model.prep.kind == "tokens":
            _check_token_ids(x, model.prep.vocab, path.name, start + 1)
        yield x, None


def _check_token_ids(x: np.ndarray, vocab: int, name: str, first: int) -> None:
    """Token ids are whole numbers the network embeds: 0 .. vocab-1 (onnxruntime's Gather fails in many
    lines past the end, and the graph's cast would truncate 2.5 to id 2 without a word)."""
    bad = (x != np.floor(x)) | (x < 0) | (x >= (vocab or np.inf))  # vocab 0: a file from before it was kept
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        ids = f"0 .. {vocab - 1}" if vocab else "whole numbers from 0"
        raise DataError(f"{name}: example {first + row} holds {x[row, col]:g} at position {col}, not a token id "
                        f"({ids})")
