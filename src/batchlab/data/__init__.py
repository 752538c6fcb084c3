"""Generate, load, split and save datasets. Every array is float32 examples and int64 labels.

sources   where examples come from (rows, images, token sequences), before the split
"""

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
from batchlab.data.sources import DataError, Kind, raw_table

__all__ = ["SPLITS", "DataError", "Dataset", "Kind", "Shape", "Split", "build", "load", "raw_table", "save", "shape"]

SPLITS = ("train", "val", "test")
REGENERATE = "run `batchlab generate` (or `dvc repro generate`, `dvc checkout data/prepared`)"


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
    kind: Kind = "rows"
    vocab: int = 0  # tokens: ids 0 .. vocab-1

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One example's shape: (F,) rows, (C, H, W) images, (T,) tokens."""
        return tuple(int(n) for n in self.train.x.shape[1:])

    @property
    def n_features(self) -> int:
        """Numbers per example (F for rows)."""
        return math.prod(self.input_shape)

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
            "kind": self.kind,
            "input_shape": list(self.input_shape),
            "vocab": self.vocab,
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


def build(cfg: DataConfig) -> tuple[Dataset, dict[str, list[float]]]:
    """Stratified train/val/test split, standardized with statistics of the train split only."""
    from sklearn.model_selection import train_test_split

    raw = raw_table(cfg)
    x, feature_names, class_names = raw.x, raw.feature_names, raw.class_names
    y = np.asarray(raw.y, dtype=np.int64)
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
    (train, val, test), scaler = _scaled(raw.kind, (x_train, x_val, x_test), feature_names, source)
    dataset = Dataset(
        train=Split(train, y_train),
        val=Split(val, y_val),
        test=Split(test, y_test),
        feature_names=feature_names,
        class_names=class_names,
        kind=raw.kind,
        vocab=raw.vocab,
    )
    return dataset, scaler


def scale_axes(kind: Kind, ndim: int) -> tuple[int, ...]:
    """The axes the train split's statistics are taken over: every example for each feature (rows),
    every example and pixel for each channel (images)."""
    return (0,) if kind == "rows" else (0, *range(2, ndim))


def _scaled(
    kind: Kind, splits: tuple[np.ndarray, ...], feature_names: list[str], source: str
) -> tuple[tuple[np.ndarray, ...], dict[str, list[float]]]:
    """The splits standardized with the train split's statistics (per feature, per channel; tokens
    are ids: left as they are), as float32; the scaler, flat."""
    if kind == "tokens":
        return tuple(a.astype(np.float32) for a in splits), {"mean": [0.0], "std": [1.0]}
    axes = scale_axes(kind, splits[0].ndim)
    # huge finite values overflow here (the mean sums first): checked below instead of warned about
    with np.errstate(over="ignore", invalid="ignore"):
        mean = splits[0].mean(axis=axes, keepdims=True)
        std = splits[0].std(axis=axes, keepdims=True)
        std[std == 0] = 1.0  # constant columns stay constant instead of dividing by zero
        scaled = tuple(((a - mean) / std).astype(np.float32) for a in splits)
    bad = ~np.isfinite(np.concatenate(scaled)).all(axis=axes)
    if bad.any():
        what = "columns" if kind == "rows" else "channels"
        names = feature_names if kind == "rows" else [str(c) for c in range(bad.size)]
        where = [name for name, b in zip(names, bad.ravel(), strict=True) if b]
        raise DataError(f"{source}: scaling gave non-finite values in {what} {where} "
                        f"(values too large for float64/float32?); rescale those {what} first")
    return scaled, {"mean": mean.ravel().tolist(), "std": std.ravel().tolist()}


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
    """What to name in an error about the rows: the CSV's or the .npz's file name, or the source."""
    if cfg.source in ("csv", "npz"):
        return Path((cfg.csv_path if cfg.source == "csv" else cfg.npz_path) or "").name
    return f"data.source {cfg.source}"


EXAMPLES = "examples.csv"  # in the prepared folder: raw rows for `batchlab predict`
EXAMPLE_ARRAYS = "examples.npy"  # the same for images and tokens: raw examples, as predict takes them
EXAMPLE_ROWS = 20


def unscaled(dataset: Dataset, scaler: dict[str, list[float]], x: np.ndarray) -> np.ndarray:
    """Prepared examples back to raw values (float64; token ids int64): what `batchlab predict` takes."""
    if dataset.kind == "tokens":
        return x.astype(np.int64)
    shape = (1, -1, *([1] * (x.ndim - 2))) if dataset.kind == "images" else (1, -1)
    return x.astype(np.float64) * np.asarray(scaler["std"]).reshape(shape) + np.asarray(scaler["mean"]).reshape(shape)


def save(dataset: Dataset, scaler: dict[str, list[float]], folder: str | Path, inputs_key: str = "") -> dict[str, Any]:
    """Write one .npy per array (byte-for-byte reproducible) plus dataset.json, atomically.

    `inputs_key` names what produced the data (params + code), so a cache can tell it is current.
    """
    summary = {**dataset.summary(), "array_sha256": array_hashes(dataset), "scaler": scaler, "inputs_key": inputs_key}
    with atomic.atomic_path(folder) as tmp:
        tmp.mkdir()
        for name in SPLITS:
            split: Split = getattr(dataset, name)
            np.save(tmp / f"x_{name}.npy", split.x)
            np.save(tmp / f"y_{name}.npy", split.y)
        (tmp / "dataset.json").write_text(json.dumps(summary, indent=2) + "\n")
        if dataset.kind != "rows":
            np.save(tmp / EXAMPLE_ARRAYS, unscaled(dataset, scaler, dataset.test.x[:EXAMPLE_ROWS]))
        elif len(scaler.get("std", [])) == dataset.test.x.shape[1]:  # the scaling known: the raw rows are
            _write_examples(dataset, scaler, tmp / EXAMPLES)
    return summary


def _write_examples(dataset: Dataset, scaler: dict[str, list[float]], path: Path) -> None:
    """The first EXAMPLE_ROWS test rows as raw features (the scaling undone), with their names:
    rows to try `batchlab predict` on, as the docs' command does."""
    import csv

    rows = unscaled(dataset, scaler, dataset.test.x[:EXAMPLE_ROWS])
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(dataset.feature_names)
        writer.writerows([f"{v:.6g}" for v in row] for row in rows)


def _sha(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]


def array_hashes(dataset: Dataset) -> dict[str, str]:
    """Each array file's content hash, which dataset.json records and `load` checks."""
    splits = {name: getattr(dataset, name) for name in SPLITS}
    return {f"{a}_{name}.npy": _sha(getattr(split, a)) for name, split in splits.items() for a in ("x", "y")}


def load(folder: str | Path) -> Dataset:
    """The dataset `save` wrote; a missing or damaged file is a DataError naming it, and so is an
    array whose content no longer matches the hash dataset.json recorded for it (changed after
    `generate`: training on it would go on without a word)."""
    folder = Path(folder)
    meta_path = folder / "dataset.json"
    if not meta_path.is_file():
        raise DataError(f"no prepared dataset in {folder}; {REGENERATE}")
    try:
        meta = json.loads(meta_path.read_text())
        feature_names, class_names = list(meta["feature_names"]), list(meta["class_names"])
        input_shape = tuple(int(n) for n in meta.get("input_shape", [len(feature_names)]))
        kind, vocab = meta.get("kind", "rows"), int(meta.get("vocab", 0))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{meta_path} is damaged ({type(err).__name__}); {REGENERATE}") from err
    splits = {}
    for name in SPLITS:
        x_path, y_path = folder / f"x_{name}.npy", folder / f"y_{name}.npy"
        split = Split(_load_array(x_path), _load_array(y_path))
        if split.y.ndim != 1 or split.x.shape != (split.y.shape[0], *input_shape):
            raise DataError(f"{x_path} and {y_path} do not match {meta_path}; {REGENERATE}")
        for path, array in ((x_path, split.x), (y_path, split.y)):
            recorded = meta.get("array_sha256", {}).get(path.name)
            if recorded is not None and _sha(array) != recorded:
                raise DataError(
                    f"{path} changed after generate (its content no longer matches {meta_path}); {REGENERATE}"
                )
        splits[name] = split
    return Dataset(**splits, feature_names=feature_names, class_names=class_names, kind=kind, vocab=vocab)


@dataclass(frozen=True)
class Shape:
    """A prepared dataset's sizes, read from dataset.json alone: what choosing threads needs."""

    n_features: int  # numbers per example
    n_classes: int
    rows: dict[str, int]  # per split
    input_shape: tuple[int, ...] = ()
    kind: Kind = "rows"
    vocab: int = 0


def shape(folder: str | Path) -> Shape:
    """The sizes of the dataset `save` wrote, without reading its arrays."""
    meta_path = Path(folder) / "dataset.json"
    if not meta_path.is_file():
        raise DataError(f"no prepared dataset in {folder}; {REGENERATE}")
    try:
        meta = json.loads(meta_path.read_text())
        rows = {name: int(meta["splits"][name]["rows"]) for name in SPLITS}
        input_shape = tuple(int(n) for n in meta.get("input_shape", [len(meta["feature_names"])]))
        return Shape(math.prod(input_shape), len(meta["class_names"]), rows, input_shape, meta.get("kind", "rows"),
                     int(meta.get("vocab", 0)))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{meta_path} is damaged ({type(err).__name__}); {REGENERATE}") from err


def _load_array(path: Path) -> np.ndarray:
    try:
        return np.load(path)
    except FileNotFoundError:
        raise DataError(f"{path} is missing; {REGENERATE}") from None
    except (OSError, ValueError, EOFError) as err:  # truncated, empty, or not an .npy file
        raise DataError(f"{path} is damaged ({type(err).__name__}); {REGENERATE}") from err
