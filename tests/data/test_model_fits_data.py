"""`batchlab validate` refuses a built-in model.name that cannot take data.source's examples, in one line,
before DVC removes any output (train refuses them too, but only after `dvc repro` deleted the last model):
the MLP takes rows, the CNN images, the transformer token ids."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given

from batchlab.config.sections import DataConfig
from batchlab.validate import data_kind
from tests.support import TINY, merge, run, write_params
from tests.support.fuzz import FUZZ, TRAP_FILE, quiet, source_npz

ROWS = "feature rows (N, F)"
IMAGES = "images (N, C, H, W)"
TOKENS = "token ids (N, T) with a vocab"
FOR = {
    "mlp": "data.source synthetic, csv, breast_cancer, digits, wine, iris or an .npz with x (N, F)",
    "cnn": "data.source digits_images or an .npz with x (N, H, W) or (N, C, H, W)",
    "transformer": "data.source sequences or an .npz with x (N, T) and an integer vocab",
}
TAKES = {"mlp": ROWS, "cnn": IMAGES, "transformer": TOKENS}
RIGHT = {ROWS: "mlp", IMAGES: "cnn", TOKENS: "transformer"}
NPZ = "npz (data/raw/mine.npz)"
MISFITS = [  # model.name, data.source, what the source gives
    ("mlp", "digits_images", IMAGES),
    ("mlp", "sequences", TOKENS),
    ("cnn", "synthetic", ROWS),
    ("cnn", "breast_cancer", ROWS),
    ("cnn", "sequences", TOKENS),
    ("transformer", "digits", ROWS),
    ("transformer", "digits_images", IMAGES),
    ("mlp", "npz:images", IMAGES),
    ("cnn", "npz:tokens", TOKENS),
    ("transformer", "npz:rows", ROWS),  # integer columns without a vocab are rows
]
FITS = [("mlp", "synthetic"), ("mlp", "npz:rows"), ("cnn", "digits_images"), ("cnn", "npz:images"),
        ("transformer", "sequences"), ("transformer", "npz:tokens")]  # fmt: skip


def _params(root: Path, model: str, source: str) -> dict[str, Any]:
    data: dict[str, Any] = {"source": source}
    if source.startswith("npz:"):
        rng = np.random.default_rng(0)
        y = np.arange(200) % 2
        arrays = {
            "rows": {"x": rng.normal(size=(200, 5)), "y": y},
            "images": {"x": rng.normal(size=(200, 2, 6, 6)), "y": y},
            "tokens": {"x": rng.integers(0, 5, size=(200, 7)), "y": y, "vocab": np.int64(5)},
        }[source.partition(":")[2]]
        (root / "data/raw").mkdir(parents=True, exist_ok=True)
        np.savez(root / "data/raw/mine.npz", **arrays)  # type: ignore[arg-type]
        data = {"source": "npz", "npz_path": "data/raw/mine.npz"}
    return merge(TINY, {"data": data, "model": {"name": model}})


@pytest.mark.integration
@pytest.mark.parametrize(("model", "source", "gives"), MISFITS)
def test_validate_names_a_model_that_cannot_take_the_data_and_what_would_fit(
    workdir: Path, model: str, source: str, gives: str
) -> None:
    write_params(workdir, _params(workdir, model, source))
    proc = run(["batchlab", "validate"], workdir, check=False)
    named = NPZ if source.startswith("npz:") else source
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"batchlab: error: model.name {model} takes {TAKES[model]}, but data.source {named} gives {gives}: "
        f"use model.name {RIGHT[gives]} for this data, or {FOR[model]}"
    ], proc.stderr
    assert not (workdir / ".batchlab/params.ok").exists()


@pytest.mark.integration
@pytest.mark.parametrize(("model", "source"), FITS)
def test_validate_passes_a_model_that_takes_the_data(workdir: Path, model: str, source: str) -> None:
    write_params(workdir, _params(workdir, model, source))
    proc = run(["batchlab", "validate"], workdir, check=False)
    assert proc.returncode == 0, proc.stderr
    assert (workdir / ".batchlab/params.ok").is_file()


@FUZZ
@given(blob=source_npz())
def test_the_npz_sources_kind_is_read_or_left_to_generate_on_any_file(blob: bytes) -> None:
    """validate reads an .npz's kind from x's header without a traceback on any file: None leaves
    naming what is wrong to generate."""
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "data/raw").mkdir(parents=True)
        (Path(folder) / "data/raw/x.npz").write_bytes(blob)
        with quiet():
            kind = data_kind(DataConfig(source="npz", npz_path="data/raw/x.npz"), Path(folder))
    assert kind in (None, "rows", "images", "tokens")
    assert not TRAP_FILE.exists()
