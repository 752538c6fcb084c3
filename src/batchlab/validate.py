"""`batchlab validate`: reject a bad params.yaml before any stage's outputs are removed.

DVC deletes a stage's outputs before its command runs, so a bad value caught inside `train`
has already cost the last good model and reports (`cache: false` ones cannot be checked out
again). dvc.yaml makes every stage depend on this stage's stamp. The stamp's content never
changes, so a valid edit reruns only the stages that read the changed keys; an invalid one
stops `dvc repro` here. Imports neither torch nor mlflow: it runs on every params change.
"""

from __future__ import annotations

import csv
from pathlib import Path

from batchlab import atomic
from batchlab.config import Config, ConfigError, DataConfig
from batchlab.data import split_sizes

STAMP = Path(".batchlab") / "params.ok"
STAMP_TEXT = "params.yaml passed `batchlab validate`\n"  # constant: see the module docstring
RAW_DATA = Path("data") / "raw"  # generate's data dependency in dvc.yaml
BUNDLED_ROWS = {"breast_cancer": 569, "digits": 1797, "wine": 178, "iris": 150}


def train_rows(cfg: DataConfig, root: Path = Path(".")) -> int | None:
    """Rows the train split will have, from the params alone (scikit-learn's split arithmetic);
    None when that needs the data (a CSV that cannot be read yet: generate reports why)."""
    if cfg.source == "synthetic":
        rows = cfg.samples
    elif cfg.source == "csv":
        try:
            with (root / (cfg.csv_path or "")).open(newline="") as f:
                rows = sum(1 for _ in csv.reader(f)) - 1  # minus the header
        except (OSError, UnicodeDecodeError, csv.Error):
            return None
    else:
        rows = BUNDLED_ROWS[cfg.source]
    return split_sizes(rows, cfg.test_fraction, cfg.val_fraction / (1 - cfg.test_fraction))[0]


def batch_fits(batch_size: int, n_train: int, key: str) -> None:
    """A batch fills at least one step of the train split (every step is a full batch)."""
    if batch_size > n_train:
        raise ConfigError(f"{key} ({batch_size}) is larger than the train split ({n_train} rows)")


def batches_fit(cfg: Config, n_train: int) -> None:
    """Every batch size the params ask for fills at least one step of the train split."""
    batch_fits(cfg.train.batch_size, n_train, "train.batch_size")
    too_big = [b for b in cfg.sweep.batch_sizes if b > n_train]
    if too_big:
        raise ConfigError(f"sweep.batch_sizes {too_big} are larger than the train split ({n_train} rows)")


def csv_inside_raw(cfg: DataConfig) -> None:
    """DVC sees a CSV only as part of generate's dependency data/raw/: a file elsewhere could be
    edited without any stage rerunning."""
    if cfg.source != "csv":
        return
    path = Path(cfg.csv_path or "")
    if path.is_absolute() or RAW_DATA not in (path.parent, *path.parent.parents):
        raise ConfigError(
            f"data.csv_path must be a file under {RAW_DATA}/ (generate's DVC dependency), got {str(path)!r}; "
            f"move it there, e.g. {RAW_DATA / path.name}"
        )


def validate(cfg: Config, root: Path = Path(".")) -> None:
    """Everything that can be checked from the params alone; writes the stamp when it passes."""
    csv_inside_raw(cfg.data)
    n_train = train_rows(cfg.data, root)
    if n_train is not None:
        batches_fit(cfg, n_train)
    atomic.write_text(root / STAMP, STAMP_TEXT)
