"""Where examples come from, before the split: make_classification, scikit-learn's bundled sets, a
CSV, your own arrays (.npz: rows, images or token ids), the digits as images, a synthetic token-sequence task.

Each source gives a `Raw`: examples x of shape (N, ...) and labels, with what the rest of the
pipeline needs to know about their kind: rows (N, F) are scaled per feature, images (N, C, H, W)
per channel, tokens (N, T) (integer ids, carried as float32) not at all.
"""

from __future__ import annotations

import tokenize
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from batchlab.config import DataConfig

Kind = Literal["rows", "images", "tokens"]


class DataError(ValueError):
    """Input data that cannot be trained on; the message says what is wrong."""


# what np.load raises on a user's file that is no plain array: not an .npy nor a zip, empty, truncated,
# damaged (zipfile's and zlib's own errors), an object array (pickle refused), a zip it cannot open
# (encrypted, an unknown compression), a header whose shape is too large to map or to allocate, or
# that numpy's tokenizer cannot read
UNREADABLE_ARRAYS = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error, NotImplementedError,
                     RuntimeError, OverflowError, MemoryError, tokenize.TokenError)


def unreadable_array(name: str, what: str, err: BaseException) -> DataError:
    """The one line for an array file np.load refused: `name` is not `what`, and numpy's reason."""
    why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if "allow_pickle" in why:  # numpy's words name a flag the user cannot pass
        why = "it holds Python objects (an object array), which are never unpickled; save numeric arrays"
    elif isinstance(err, tokenize.TokenError):  # its text is a tuple of the tokenizer's
        why = "its .npy header cannot be parsed"
    return DataError(f"{name} is not {what}: {why}")


@dataclass(frozen=True)
class Raw:
    x: np.ndarray  # (N, ...) float64 (tokens: integer ids)
    y: np.ndarray  # N labels, any hashable (indices into class_names once encoded)
    feature_names: list[str]  # rows: one per column; images and tokens: none
    class_names: list[str]
    kind: Kind = "rows"
    vocab: int = 0  # tokens: ids are 0 .. vocab-1


def raw_table(cfg: DataConfig) -> Raw:
    """The source's examples, labels, feature names and class names before the split."""
    # imported here: scikit-learn costs ~1 s at start-up and only generate needs it
    from sklearn import datasets as skdatasets

    if cfg.source == "synthetic":
        x, y = skdatasets.make_classification(
            n_samples=cfg.samples,
            n_features=cfg.features,
            n_informative=cfg.informative,
            n_redundant=min(2, cfg.features - cfg.informative),
            n_classes=cfg.classes,
            class_sep=cfg.class_sep,
            flip_y=cfg.label_noise,
            random_state=cfg.seed,
        )
        return Raw(x, y, [f"x{i}" for i in range(cfg.features)], [str(c) for c in range(cfg.classes)])
    if cfg.source == "csv":
        return _read_csv(Path(cfg.csv_path or ""), cfg.target)
    if cfg.source == "npz":
        return read_npz(Path(cfg.npz_path or ""))
    if cfg.source == "sequences":
        return sequences(cfg)
    if cfg.source == "digits_images":
        bunch = skdatasets.load_digits()
        return Raw(bunch.images[:, None].astype(np.float64), bunch.target, [], [str(n) for n in bunch.target_names],
                   "images")
    bunch = getattr(skdatasets, f"load_{cfg.source}")()
    return Raw(bunch.data, bunch.target, [str(n) for n in bunch.feature_names], [str(n) for n in bunch.target_names])


def sequences(cfg: DataConfig) -> Raw:
    """A token-sequence task: `seq_len` ids drawn uniformly from 0 .. vocab-1; the label is the id
    among 0 .. classes-1 that occurs most often (the smallest on a tie), a `label_noise` share flipped."""
    rng = np.random.default_rng(cfg.seed)
    tokens = rng.integers(0, cfg.vocab, size=(cfg.samples, cfg.seq_len))
    counts = np.stack([(tokens == c).sum(axis=1) for c in range(cfg.classes)], axis=1)
    y = counts.argmax(axis=1)
    flip = rng.random(cfg.samples) < cfg.label_noise
    y[flip] = rng.integers(0, cfg.classes, size=int(flip.sum()))
    return Raw(tokens.astype(np.float64), y, [], [str(c) for c in range(cfg.classes)], "tokens", cfg.vocab)


def read_npz(path: Path) -> Raw:
    """Your own arrays: `x` (N, F) rows, (N, H, W) or (N, C, H, W) images; `y` N labels. With an
    integer `vocab` beside them, x is (N, T) token ids 0 .. vocab-1 (for the transformer)."""
    if not path.is_file():
        raise DataError(f"data.npz_path {str(path)!r} does not exist")
    try:
        with np.errstate(over="ignore"), np.load(path, allow_pickle=False) as arrays:  # a huge shape: refused
            missing = [k for k in ("x", "y") if k not in arrays.files]
            if missing:
                raise DataError(f"{path.name} has no array {missing[0]!r}; it needs x (N, ...) and y (N labels), "
                                f"has {arrays.files}")
            x, y = arrays["x"], arrays["y"]
            vocab = arrays["vocab"] if "vocab" in arrays.files else None
    except UNREADABLE_ARRAYS as err:
        if isinstance(err, DataError):
            raise
        raise unreadable_array(path.name, "a readable .npz of plain arrays", err) from None
    if vocab is not None:
        x = token_ids(path.name, x, y, vocab)
    if y.ndim != 1 or x.ndim not in (2, 3, 4) or len(x) != len(y):
        raise DataError(f"{path.name}: x has shape {x.shape} and y {y.shape}; need x (N, F), (N, H, W) or "
                        "(N, C, H, W) and y (N,) with the same N")
    if 0 in x.shape[1:]:
        raise DataError(f"{path.name}: x has shape {x.shape}, examples of no values; need at least one feature")
    if not (np.issubdtype(x.dtype, np.number) and not np.issubdtype(x.dtype, np.complexfloating)):
        raise DataError(f"{path.name}: x must be real numbers, got dtype {x.dtype}")
    x = x.astype(np.float64)
    if not np.isfinite(x).all():
        bad = int(np.argwhere(~np.isfinite(x.reshape(len(x), -1)))[0][0])
        raise DataError(f"{path.name}: x holds NaN or infinite values (first in example {bad}); fix them first")
    if not len(y):
        raise DataError(f"{path.name}: x and y hold no examples; need rows of at least 2 classes")
    if np.issubdtype(y.dtype, np.inexact) and not np.isfinite(y).all():  # NaN is no class (nor equal to itself)
        first = int(np.argmin(np.isfinite(y)))
        raise DataError(f"{path.name}: y holds NaN or infinite labels (first in example {first}); labels are class "
                        "ids or names")
    classes = sorted(np.unique(y).tolist(), key=str)
    if len(classes) < 2:
        raise DataError(f"{path.name}: y has a single class ({classes[0]!r}); need at least 2")
    index = {c: i for i, c in enumerate(classes)}
    labels = np.asarray([index[v] for v in y.tolist()])
    if vocab is not None:
        return Raw(x, labels, [], [str(c) for c in classes], "tokens", int(vocab))
    if x.ndim == 2:
        return Raw(x, labels, [f"x{i}" for i in range(x.shape[1])], [str(c) for c in classes])
    return Raw(x if x.ndim == 4 else x[:, None], labels, [], [str(c) for c in classes], "images")


# every prepared array is float32, which holds each integer up to 2**24 exactly: larger ids would merge
MAX_VOCAB = 2**24


def token_ids(name: str, x: np.ndarray, y: np.ndarray, vocab: np.ndarray) -> np.ndarray:
    """An .npz's x as token ids (float64, as every source's x), checked against its `vocab`: x is
    (N, T) integers, each in 0 .. vocab-1; one line naming what is wrong otherwise."""
    if vocab.ndim != 0 or vocab.dtype == np.bool_ or not np.issubdtype(vocab.dtype, np.integer):
        raise DataError(f"{name}: vocab must be one integer (the number of token ids), got {vocab.dtype} of "
                        f"shape {vocab.shape}")
    if not 2 <= int(vocab) <= MAX_VOCAB:
        raise DataError(f"{name}: vocab must be between 2 and {MAX_VOCAB} (ids travel as float32), got {int(vocab)}")
    if x.ndim != 2 or y.ndim != 1 or len(x) != len(y) or 0 in x.shape:
        raise DataError(f"{name}: x has shape {x.shape} and y {y.shape}; token ids need x (N, T) and y (N,) with "
                        "the same N, T at least 1")
    if x.dtype == np.bool_ or not np.issubdtype(x.dtype, np.integer):
        raise DataError(f"{name}: x holds {x.dtype} values, but with a vocab it is token ids: save it as integers "
                        "(e.g. x.astype(np.int64))")
    bad = (x < 0) | (x >= int(vocab))
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise DataError(f"{name}: x holds token id {int(x[row, col])} (example {row}, position {col}), outside "
                        f"0 .. vocab-1 = 0 .. {int(vocab) - 1}")
    return x.astype(np.float64)


def _read_csv(path: Path, target: str) -> Raw:
    import pandas as pd

    if not path.is_file():
        raise DataError(f"data.csv_path {str(path)!r} does not exist")
    try:
        frame = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise DataError(f"{path.name} is empty; it needs a header row and one row per example") from None
    except UnicodeDecodeError:
        raise DataError(f"{path.name} is not UTF-8 text; save it as UTF-8 (e.g. iconv -t utf-8)") from None
    except pd.errors.ParserError as err:
        raise DataError(f"{path.name} is not a valid CSV: {str(err).strip().splitlines()[0]}") from None
    if frame.empty:
        raise DataError(f"{path.name} has a header but no rows")
    if target not in frame.columns:
        raise DataError(f"data.target column {target!r} is not in {path.name}; columns are {list(frame.columns)}")
    features = frame.drop(columns=[target])
    if features.columns.empty:
        raise DataError(f"{path.name} has no feature columns, only the target {target!r}; add the features")
    non_numeric = [c for c in features.columns if not pd.api.types.is_numeric_dtype(features[c])]
    if non_numeric:
        raise DataError(f"{path.name}: feature columns must be numeric; not numeric: {non_numeric}")
    nan_cols = frame.columns[frame.isna().any()].tolist()
    if nan_cols:
        raise DataError(f"{path.name}: missing values (NaN) in columns {nan_cols}; fill or drop them first")
    x = features.to_numpy(dtype=np.float64)
    inf_cols = features.columns[np.isinf(x).any(axis=0)].tolist()
    if inf_cols:
        raise DataError(f"{path.name}: infinite values (inf) in columns {inf_cols}; replace or drop them first")
    classes = sorted(frame[target].unique().tolist(), key=str)
    if len(classes) < 2:
        raise DataError(f"{path.name}: target {target!r} has a single class ({classes[0]!r}); need at least 2")
    index = {c: i for i, c in enumerate(classes)}
    y = frame[target].map(index).to_numpy()
    return Raw(x, y, [str(c) for c in features.columns], [str(c) for c in classes])
