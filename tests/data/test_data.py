from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from batchlab import data
from batchlab.config import DataConfig
from batchlab.data import DataError


def test_synthetic_split_is_stratified_and_scaled_on_train_only() -> None:
    ds, scaler = data.build(DataConfig(samples=1000, classes=3, informative=5, features=8))
    sizes = [ds.train.y.size, ds.val.y.size, ds.test.y.size]
    assert sum(sizes) == 1000 and sizes == [700, 150, 150]
    for split in (ds.val, ds.test):
        # class shares within 2 points of the train split's
        assert np.allclose(np.bincount(split.y) / split.y.size, np.bincount(ds.train.y) / ds.train.y.size, atol=0.02)
    np.testing.assert_allclose(ds.train.x.mean(axis=0), 0, atol=1e-5)
    np.testing.assert_allclose(ds.train.x.std(axis=0), 1, atol=1e-4)
    assert not np.allclose(ds.test.x.mean(axis=0), 0, atol=1e-5)  # test rows were not used for the fit
    assert len(scaler["mean"]) == 8 and ds.train.x.dtype == np.float32 and ds.train.y.dtype == np.int64


def test_same_params_give_same_bytes_and_hash(tmp_path: Path) -> None:
    cfg = DataConfig(samples=300)
    a, b = data.build(cfg)[0], data.build(cfg)[0]
    assert a.content_hash() == b.content_hash()
    assert data.build(DataConfig(samples=300, seed=1))[0].content_hash() != a.content_hash()
    data.save(a, {"mean": [], "std": []}, tmp_path / "one")
    data.save(b, {"mean": [], "std": []}, tmp_path / "two")
    for f in (tmp_path / "one").iterdir():
        assert f.read_bytes() == (tmp_path / "two" / f.name).read_bytes(), f.name


@pytest.mark.parametrize(("source", "n_classes"), [("iris", 3), ("wine", 3), ("breast_cancer", 2), ("digits", 10)])
def test_bundled_datasets_load_without_network(source: str, n_classes: int) -> None:
    ds, _ = data.build(DataConfig(source=source))
    assert ds.n_classes == n_classes and len(ds.feature_names) == ds.n_features


def test_save_load_round_trip_and_summary(tmp_path: Path) -> None:
    ds, scaler = data.build(DataConfig(samples=300))
    summary = data.save(ds, scaler, tmp_path / "prepared")
    back = data.load(tmp_path / "prepared")
    assert back.content_hash() == ds.content_hash() == summary["content_hash"]
    assert summary["splits"]["train"]["rows"] == ds.train.y.size
    assert sum(summary["splits"]["test"]["class_counts"]) == ds.test.y.size
    assert [p.name for p in tmp_path.iterdir()] == ["prepared"]  # no temporary left behind


def _csv(tmp_path: Path, frame: pd.DataFrame) -> DataConfig:
    path = tmp_path / "rows.csv"
    frame.to_csv(path, index=False)
    return DataConfig(source="csv", csv_path=str(path), target="label")


def _frame(n: int = 60) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    return pd.DataFrame({"a": rng.normal(size=n), "b": rng.normal(size=n), "label": ["yes", "no"] * (n // 2)})


def test_csv_with_string_labels_trains_like_any_source(tmp_path: Path) -> None:
    ds, _ = data.build(_csv(tmp_path, _frame()))
    assert ds.class_names == ["no", "yes"] and ds.feature_names == ["a", "b"]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda f: f.rename(columns={"label": "y"}), "data.target column 'label' is not in rows.csv; columns are"),
        (lambda f: f.assign(a=[np.nan, *list(f.a[1:])]), "missing values (NaN) in columns ['a']"),
        (lambda f: f.assign(b=[np.inf, *list(f.b[1:])]), "infinite values (inf) in columns ['b']"),
        (lambda f: f.assign(a=[-np.inf, *list(f.a[1:])], b=[np.inf, *list(f.b[1:])]), "in columns ['a', 'b']"),
        (lambda f: f.assign(b="text"), "feature columns must be numeric; not numeric: ['b']"),
        (lambda f: f.assign(label="yes"), "target 'label' has a single class ('yes')"),
    ],
)
def test_bad_csv_is_rejected_with_a_clear_error(tmp_path: Path, mutate: object, message: str) -> None:
    with pytest.raises(DataError) as err:
        data.build(_csv(tmp_path, mutate(_frame())))  # type: ignore[operator]
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "rows.csv is empty"),
        (b"a,b,label\n", "rows.csv has a header but no rows"),
        ("a,b,label\n1,2,j\u00e4\n".encode("latin-1"), "rows.csv is not UTF-8 text"),
        (b'a,b,label\n1,2,"yes\n', "rows.csv is not a valid CSV"),
    ],
)
def test_unreadable_csv_is_one_line_naming_the_file(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "rows.csv"
    path.write_bytes(content)
    with pytest.raises(DataError) as err:
        data.build(DataConfig(source="csv", csv_path=str(path), target="label"))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_csv_too_small_for_the_split_names_the_minimum(tmp_path: Path) -> None:
    # 3 rows per class pass the per-class check, but 15% of 6 rows is not a test row per class
    with pytest.raises(DataError, match=r"rows.csv: 6 rows are too few .* at least 8 rows") as err:
        data.build(_csv(tmp_path, _frame(6)))
    assert "data.val_fraction=0.15 and data.test_fraction=0.15" in str(err.value)
    data.build(_csv(tmp_path, _frame(8)))  # the minimum it names is enough


def test_values_that_overflow_when_scaled_are_rejected_not_saved_as_nan(tmp_path: Path) -> None:
    frame = _frame().assign(b=1.5e308)  # finite, but the mean (a sum first) overflows float64
    with pytest.raises(DataError, match=r"rows.csv: scaling gave non-finite values in columns \['b'\]"):
        data.build(_csv(tmp_path, frame))


def test_missing_csv_and_missing_prepared_folder(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        data.build(DataConfig(source="csv", csv_path=str(tmp_path / "nope.csv")))
    with pytest.raises(DataError, match="run `batchlab generate`"):
        data.load(tmp_path)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    ("name", "damage"),
    [
        ("x_train.npy", _truncate),
        ("y_val.npy", lambda p: p.write_bytes(b"")),
        ("x_test.npy", Path.unlink),
        ("dataset.json", lambda p: p.write_text("{not json")),
        ("dataset.json", lambda p: p.write_text("[1, 2]")),
    ],
)
def test_damaged_prepared_file_is_one_line_naming_it_and_the_fix(tmp_path: Path, name: str, damage: object) -> None:
    ds, scaler = data.build(DataConfig(samples=300))
    data.save(ds, scaler, tmp_path / "prepared")
    damage(tmp_path / "prepared" / name)  # type: ignore[operator]
    with pytest.raises(DataError) as err:
        data.load(tmp_path / "prepared")
    text = str(err.value)
    assert str(tmp_path / "prepared" / name) in text and "\n" not in text
    assert "run `batchlab generate` (or `dvc repro generate`, `dvc checkout data/prepared`)" in text


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("x_train.npy", lambda a: a + np.where(np.arange(a.size).reshape(a.shape) == 7, 1e-6, 0.0).astype(a.dtype)),
        ("y_val.npy", lambda a: a[::-1].copy()),  # the same labels, reordered
    ],
)
def test_an_array_changed_after_generate_is_one_line_naming_it(tmp_path: Path, name: str, change: Any) -> None:
    """A prepared array changed after `generate`, still a valid .npy of the right shape (one value
    moved by 1e-6; labels reordered): dataset.json's hash of it no longer matches."""
    ds, scaler = data.build(DataConfig(samples=300))
    data.save(ds, scaler, tmp_path / "prepared")
    path = tmp_path / "prepared" / name
    np.save(path, change(np.load(path)))
    with pytest.raises(DataError) as err:
        data.load(tmp_path / "prepared")
    text = str(err.value)
    assert text.startswith(f"{path} changed after generate (its content no longer matches ") and "\n" not in text
    assert text.endswith("run `batchlab generate` (or `dvc repro generate`, `dvc checkout data/prepared`)")


@pytest.mark.integration
def test_a_changed_prepared_array_stops_train_evaluate_and_the_sweep_with_one_line(workdir: Path) -> None:
    from batchlab import stages
    from batchlab.paths import Paths
    from tests.support import run, tiny_config, write_params

    cfg = tiny_config()
    write_params(workdir, cfg.model_dump(mode="json"))
    stages.generate(cfg, Paths(workdir))
    run(["batchlab", "train"], workdir)
    path = workdir / "data/prepared/x_train.npy"
    array = np.load(path)
    array[0, 0] += 0.5
    np.save(path, array)
    for stage in ("train", "evaluate", "sweep"):
        proc = run(["batchlab", stage], workdir, check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (stage, proc.stderr[-2000:])
        changed = f"{path.relative_to(workdir)} changed after generate"
        why = "(its content no longer matches data/prepared/dataset.json)"
        assert lines[0] == f"batchlab: error: {changed} {why}; {data.REGENERATE}", lines
    assert not (workdir / "sweep").exists()  # the sweep stopped before it started
