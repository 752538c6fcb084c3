"""Generate, load, split and save datasets. Every array is float32 features and int64 labels."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batchlab import atomic
from batchlab.config import DataConfig

SPLITS = ("train", "val", "test")
REGENERATE = "run `batchlab generate` (or `dvc repro generate`, `dvc checkout data/prepared`)"


class DataError(ValueError):
    """Input data that cannot be trained on; the message says what is wrong."""


@dataclass(frozen=True)
class Split:
    x: np.ndarray
    y: np.ndarray


@dataclass(frozen=True)
class Dataset:
    train: Split
    val: Split
    test: Split
    feature_names: list[str]
    class_names: list[str]

    @property
    def n_features(self) -> int:
        return int(self.train.x.shape[1])

    @property
    def n_classes(self) -> int:
        return len(self.class_names)

    def content_hash(self) -> str:
        digest = hashlib.sha256()
        for name in SPLITS:
            split: Split = getattr(self, name)
            digest.update(np.ascontiguousarray(split.x).tobytes())
            digest.update(np.ascontiguousarray(split.y).tobytes())
        return digest.hexdigest()[:16]

    def summary(self) -> dict[str, Any]:
        return {
            "content_hash": self.content_hash(),
            "n_features": self.n_features,
            "n_classes": self.n_classes,
            "feature_names": self.feature_names,
            "class_names": self.class_names,
            "splits": {
                name: {
                    "rows": int(getattr(self, name).y.shape[0]),
                    "class_counts": np.bincount(getattr(self, name).y, minlength=self.n_classes).tolist(),
                }
                for name in SPLITS
            },
        }


def raw_table(cfg: DataConfig) -> tuple[np.ndarray, np.ndarray, list[str], list[str]]:
    """Rows, labels (any hashable), feature names and class names before the split."""
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
        return x, y, [f"x{i}" for i in range(cfg.features)], [str(c) for c in range(cfg.classes)]
    if cfg.source == "csv":
        return _read_csv(Path(cfg.csv_path or ""), cfg.target)
    bunch = getattr(skdatasets, f"load_{cfg.source}")()
    return bunch.data, bunch.target, [str(n) for n in bunch.feature_names], [str(n) for n in bunch.target_names]


def _read_csv(path: Path, target: str) -> tuple[np.ndarray, np.ndarray, list[str], list[str]]:
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
    return x, y, [str(c) for c in features.columns], [str(c) for c in classes]


def build(cfg: DataConfig) -> tuple[Dataset, dict[str, list[float]]]:
    """Stratified train/val/test split, standardized with statistics of the train split only."""
    from sklearn.model_selection import train_test_split

    x, y, feature_names, class_names = raw_table(cfg)
    y = np.asarray(y, dtype=np.int64)
    counts = np.bincount(y)
    source = _source_name(cfg)
    if counts.min() < 3:
        raise DataError(
            f"{source}: every class needs at least 3 rows to split train/val/test; counts are {counts.tolist()}"
        )
    val_share = cfg.val_fraction / (1 - cfg.test_fraction)
    if min(split_sizes(len(y), cfg.test_fraction, val_share)) < len(counts):
        least = min_rows(len(counts), cfg.test_fraction, val_share)
        raise DataError(
            f"{source}: {len(y)} rows are too few to split with data.val_fraction={cfg.val_fraction} and "
            f"data.test_fraction={cfg.test_fraction}: each split needs a row of each of the {len(counts)} classes, "
            f"which takes at least {least} rows; add rows or change the fractions"
        )
    try:
        x_rest, x_test, y_rest, y_test = train_test_split(
            x, y, test_size=cfg.test_fraction, stratify=y, random_state=cfg.seed
        )
        x_train, x_val, y_train, y_val = train_test_split(
            x_rest, y_rest, test_size=val_share, stratify=y_rest, random_state=cfg.seed
        )
    except ValueError as err:  # a class too small for the stratified split: scikit-learn's words, one line
        raise DataError(f"{source}: cannot split train/val/test: {str(err).splitlines()[0]}") from None
    # huge finite values overflow here (the mean sums first): checked below instead of warned about
    with np.errstate(over="ignore", invalid="ignore"):
        mean = x_train.mean(axis=0)
        std = x_train.std(axis=0)
        std[std == 0] = 1.0  # constant columns stay constant instead of dividing by zero
        train, val, test = (((a - mean) / std).astype(np.float32) for a in (x_train, x_val, x_test))
    bad = ~np.isfinite(np.concatenate([train, val, test])).all(axis=0)
    if bad.any():
        columns = [name for name, b in zip(feature_names, bad, strict=True) if b]
        raise DataError(
            f"{_source_name(cfg)}: scaling gave non-finite values in columns {columns} "
            "(values too large for float64/float32?); rescale those columns first"
        )
    dataset = Dataset(
        train=Split(train, y_train),
        val=Split(val, y_val),
        test=Split(test, y_test),
        feature_names=feature_names,
        class_names=class_names,
    )
    return dataset, {"mean": mean.tolist(), "std": std.tolist()}


def split_sizes(n_rows: int, test_fraction: float, val_share: float) -> tuple[int, int, int]:
    """Train, val and test rows of `n_rows`, rounded as scikit-learn's train_test_split rounds them."""
    n_test = math.ceil(test_fraction * n_rows)
    n_val = math.ceil(val_share * (n_rows - n_test))
    return n_rows - n_test - n_val, n_val, n_test


def min_rows(n_classes: int, test_fraction: float, val_share: float) -> int:
    """The fewest rows whose three splits can each hold a row of every class (stratify needs that)."""
    n = 3 * n_classes
    while min(split_sizes(n, test_fraction, val_share)) < n_classes:
        n += 1
    return n


def _source_name(cfg: DataConfig) -> str:
    """What to name in an error about the rows: the CSV's file name, or the source."""
    return Path(cfg.csv_path or "").name if cfg.source == "csv" else f"data.source {cfg.source}"


EXAMPLES = "examples.csv"  # in the prepared folder: raw rows for `batchlab predict`
EXAMPLE_ROWS = 20


def save(dataset: Dataset, scaler: dict[str, list[float]], folder: str | Path, inputs_key: str = "") -> dict[str, Any]:
    """Write one .npy per array (byte-for-byte reproducible) plus dataset.json, atomically.

    `inputs_key` names what produced the data (params + code), so a cache can tell it is current.
    """
    summary = {**dataset.summary(), "scaler": scaler, "inputs_key": inputs_key}
    with atomic.atomic_path(folder) as tmp:
        tmp.mkdir()
        for name in SPLITS:
            split: Split = getattr(dataset, name)
            np.save(tmp / f"x_{name}.npy", split.x)
            np.save(tmp / f"y_{name}.npy", split.y)
        (tmp / "dataset.json").write_text(json.dumps(summary, indent=2) + "\n")
        if len(scaler.get("std", [])) == dataset.test.x.shape[1]:  # the scaling known: the raw rows are
            _write_examples(dataset, scaler, tmp / EXAMPLES)
    return summary


def _write_examples(dataset: Dataset, scaler: dict[str, list[float]], path: Path) -> None:
    """The first EXAMPLE_ROWS test rows as raw features (the scaling undone), with their names:
    rows to try `batchlab predict` on, as the docs' command does."""
    import csv

    rows = dataset.test.x[:EXAMPLE_ROWS].astype(np.float64) * np.asarray(scaler["std"]) + np.asarray(scaler["mean"])
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(dataset.feature_names)
        writer.writerows([f"{v:.6g}" for v in row] for row in rows)


def load(folder: str | Path) -> Dataset:
    """The dataset `save` wrote; a missing or damaged file is a DataError naming it."""
    folder = Path(folder)
    meta_path = folder / "dataset.json"
    if not meta_path.is_file():
        raise DataError(f"no prepared dataset in {folder}; {REGENERATE}")
    try:
        meta = json.loads(meta_path.read_text())
        feature_names, class_names = list(meta["feature_names"]), list(meta["class_names"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{meta_path} is damaged ({type(err).__name__}); {REGENERATE}") from err
    splits = {}
    for name in SPLITS:
        x_path, y_path = folder / f"x_{name}.npy", folder / f"y_{name}.npy"
        split = Split(_load_array(x_path), _load_array(y_path))
        if split.y.ndim != 1 or split.x.shape != (split.y.shape[0], len(feature_names)):
            raise DataError(f"{x_path} and {y_path} do not match {meta_path}; {REGENERATE}")
        splits[name] = split
    return Dataset(**splits, feature_names=feature_names, class_names=class_names)


@dataclass(frozen=True)
class Shape:
    """A prepared dataset's sizes, read from dataset.json alone: what choosing threads needs."""

    n_features: int
    n_classes: int
    rows: dict[str, int]  # per split


def shape(folder: str | Path) -> Shape:
    """The sizes of the dataset `save` wrote, without reading its arrays."""
    meta_path = Path(folder) / "dataset.json"
    if not meta_path.is_file():
        raise DataError(f"no prepared dataset in {folder}; {REGENERATE}")
    try:
        meta = json.loads(meta_path.read_text())
        rows = {name: int(meta["splits"][name]["rows"]) for name in SPLITS}
        return Shape(len(meta["feature_names"]), len(meta["class_names"]), rows)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{meta_path} is damaged ({type(err).__name__}); {REGENERATE}") from err


def _load_array(path: Path) -> np.ndarray:
    try:
        return np.load(path)
    except FileNotFoundError:
        raise DataError(f"{path} is missing; {REGENERATE}") from None
    except (OSError, ValueError, EOFError) as err:  # truncated, empty, or not an .npy file
        raise DataError(f"{path} is damaged ({type(err).__name__}); {REGENERATE}") from err
