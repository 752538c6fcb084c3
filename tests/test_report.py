"""The sweep's table: one row per batch size, mean and spread across seeds, a recommendation."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchlab import report


def _result(batch: int, seed: int, f1: float, speed: float) -> dict[str, float]:
    figures = dict.fromkeys(report.FIGURES, 1.0)
    return {**figures, "batch_size": batch, "seed": seed, "lr": 0.003, "test_f1_macro": f1, "samples_per_s": speed}


def test_seeds_of_a_batch_size_aggregate_to_mean_and_sample_std() -> None:
    rows = report.aggregate([_result(64, 0, 0.90, 100), _result(32, 0, 0.95, 50), _result(64, 1, 0.94, 300)])
    assert [r["batch_size"] for r in rows] == [32, 64]  # sorted by batch size
    bs64 = rows[1]
    assert bs64["seeds"] == 2 and bs64["test_f1_macro_mean"] == pytest.approx(0.92)
    assert bs64["test_f1_macro_std"] == pytest.approx(0.0282843, rel=1e-5)  # sample std, n - 1
    assert rows[0]["test_f1_macro_std"] == 0.0  # one seed: no spread


def test_csv_round_trips_every_column(tmp_path: Path) -> None:
    rows = report.aggregate([_result(16, 0, 0.9, 10.0), _result(32, 0, 0.8, 20.0)])
    (tmp_path / "t.csv").write_text(report.to_csv(rows))
    back = report.read_csv(tmp_path / "t.csv")
    assert list(back[0]) == list(rows[0]) and float(back[1]["test_f1_macro_mean"]) == pytest.approx(0.8)


def test_markdown_shows_spread_only_with_several_seeds() -> None:
    one = report.aggregate([_result(16, 0, 0.9, 10.0)])
    two = report.aggregate([_result(16, 0, 0.9, 10.0), _result(16, 1, 0.92, 12.0)])
    pick = report.recommend(one)
    assert "±" not in report.to_markdown(one, pick) and "0.9100 ± 0.0141" in report.to_markdown(two, pick)
