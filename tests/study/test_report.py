"""The study's analysis and report, from synthetic experiment results (no training)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from batchlab import atomic
from batchlab.study import analysis, critical, report


def _result(batch: int, seed: int, mult: float = 1.0, f1: float = 0.95, floor: float = 0.1) -> dict[str, Any]:
    """An experiment whose val loss falls as 1/steps toward `floor`, reaching 0.2 at S = 40 (1 + 250/B)."""
    reach_at = 40 * (1 + 250 / batch) * (1 + 0.02 * seed)
    steps = list(range(1, int(reach_at * 3)))
    return {
        "name": f"bs{batch}-seed{seed}", "batch_size": batch, "seed": seed, "lr": 0.003 * mult, "lr_multiplier": mult,
        "test_f1_macro": f1 + 0.001 * seed, "test_accuracy": f1, "samples_per_s": 1000.0 * batch**0.5,
        "epoch_seconds": 1.0, "train_seconds": 10.0, "step_memory_mib": 0.1 + 0.002 * batch, "peak_rss_mib": 600.0,
        "grad_norm_mean": 1.0, "overhead_seconds": 0.1, "curve_steps": steps,
        "curve_val_loss": [floor + 0.1 * reach_at / s for s in steps], "curve_b_simple": [200.0 for _ in steps],
    }  # fmt: skip


def test_study_finds_steps_to_target_fits_b_crit_and_reads_b_simple_at_the_target() -> None:
    results = [_result(b, seed) for b in (16, 32, 64, 128, 256, 512) for seed in (0, 1, 2)]
    found = analysis.analyse(results, n_test=600, target_val_loss=0.2, memory_budget_mb=1.0)
    assert isinstance(found.fit, critical.Fit)
    assert found.fit.b_crit == pytest.approx(250, rel=0.05) and found.fit.r2 > 0.99
    assert found.fit.b_crit_low <= found.fit.b_crit <= found.fit.b_crit_high
    first = next(r for r in found.results if r["name"] == "bs64-seed0")
    assert first["steps_to_target"] == pytest.approx(40 * (1 + 250 / 64), abs=0.01)  # the crossing, between points
    assert first["examples_to_target"] == first["steps_to_target"] * 64
    assert found.b_simple == 200.0
    figures = found.figures()
    assert figures["b_crit_over_b_simple"] == pytest.approx(found.fit.b_crit / 200)
    assert figures["largest_batch_within_budget"] == 450  # 0.1 + 0.002 B <= 1.0
    assert figures["test_rows"] == 600 and figures["seeds"] == 3


def test_auto_target_is_reached_by_every_experiment() -> None:
    results = [_result(b, 0, floor=0.1 + b / 10_000) for b in (16, 64, 256)]
    found = analysis.analyse(results, n_test=600, target_val_loss=None, memory_budget_mb=None)
    worst_best = max(min(r["curve_val_loss"]) for r in results)  # batch 256 bottoms out highest
    assert worst_best == min(results[-1]["curve_val_loss"]) and found.target == pytest.approx(worst_best * 1.02)
    assert all(r["steps_to_target"] is not None for r in found.results)
    assert "lowest val losses" in found.target_rule


def test_a_target_nobody_reaches_is_reported_per_batch_size_without_a_fit(tmp_path: Path) -> None:
    results = [_result(b, s) for b in (16, 64) for s in (0, 1, 2)]
    found = analysis.analyse(results, n_test=600, target_val_loss=0.01, memory_budget_mb=None)
    assert isinstance(found.fit, critical.NoFit) and "only 0 batch size(s)" in found.fit.reason
    text = report.write(found, tmp_path, _context())
    assert "(0/3 reached)" in text and "No critical batch size" in text and "never reached it: 16, 64" in text


def test_lr_multiplier_with_the_lowest_val_loss_wins_per_batch_size(tmp_path: Path) -> None:
    results = [_result(64, s, mult=0.5, floor=0.12) for s in (0, 1)] + [_result(64, s, floor=0.1) for s in (0, 1)]
    results += [_result(256, s, mult=0.5, floor=0.1) for s in (0, 1)] + [_result(256, s, floor=0.13) for s in (0, 1)]
    found = analysis.analyse(results, n_test=600, target_val_loss=0.2, memory_budget_mb=None)
    assert found.lr_choice == {64: 1.0, 256: 0.5}
    assert {(r["batch_size"], r["lr_multiplier"]) for r in found.results} == {(64, 1.0), (256, 0.5)}
    assert "batch 64: ×1, batch 256: ×0.5" in report.write(found, tmp_path, _context())


def _context() -> dict[str, Any]:
    return {"lr_scaling": "sqrt", "base_batch": 64, "optimizer": "adamw", "epochs": 20, "memory_budget_mb": None}


def test_report_files_state_cis_units_and_the_assumptions(tmp_path: Path) -> None:
    results = [_result(b, seed) for b in (16, 64, 256) for seed in (0, 1, 2)]
    found = analysis.analyse(results, n_test=600, target_val_loss=0.2, memory_budget_mb=None)
    text = report.write(found, tmp_path, _context())
    for name in (
        "summary.csv",
        "summary.md",
        "experiments.csv",
        "steps_vs_examples.csv",
        "curves.csv",
        "f1_vs_batch.png",
        "throughput_vs_batch.png",
        "memory_vs_batch.png",
        "steps_vs_examples.png",
        "val_loss_curves.png",
        "noise_scale_curves.png",
    ):
        assert (tmp_path / name).stat().st_size > 0, name  # fmt: skip
    assert "step memory (MiB)" in text and "peak RSS (MiB)" in text and " ± " in text
    assert "sqrt rule" in text and "adamw" in text and "3 seed(s)" in text and "B_crit" in text
    table = atomic.read_csv(tmp_path / "summary.csv")
    assert [int(r["batch_size"]) for r in table] == [16, 64, 256] and "step_memory_mib_mean" in table[0]
    points = atomic.read_csv(tmp_path / "steps_vs_examples.csv")
    first = points[0]
    assert len(points) == 9
    assert float(first["examples"]) == pytest.approx(float(first["steps"]) * int(first["batch_size"]))
    experiments = atomic.read_csv(tmp_path / "experiments.csv")  # each experiment's F1 by seed, as compared
    assert [(int(r["batch_size"]), int(r["seed"]), float(r["test_f1_macro"])) for r in experiments] == [
        (r["batch_size"], r["seed"], r["test_f1_macro"]) for r in found.results
    ]
    json.dumps(found.figures())  # plain numbers: sweep.json and MLflow metrics


def test_undefined_noise_scale_readings_are_counted_and_left_out_of_the_median(tmp_path: Path) -> None:
    results = [_result(b, seed) for b in (16, 64, 256) for seed in (0, 1)]
    results[0]["curve_b_simple"] = [math.nan for _ in results[0]["curve_steps"]]  # bs16-seed0: no reading
    results[1]["curve_b_simple"] = [400.0 for _ in results[1]["curve_steps"]]
    found = analysis.analyse(results, n_test=600, target_val_loss=0.2, memory_budget_mb=None)
    assert found.b_simple == 200.0 and found.figures()["b_simple_unread_at_target"] == 1  # median of 400 and 4 x 200
    assert "not read in 1 of the experiments that reached it" in report.write(found, tmp_path, _context())


def test_the_exact_noise_scale_is_the_headline_and_the_estimate_is_set_beside_it(tmp_path: Path) -> None:
    results = [_result(b, seed) for b in (16, 64, 256) for seed in (0, 1)]
    for i, r in enumerate(results):  # estimates 200; exact values 250, 400, ..., one experiment without
        r["curve_b_simple"] = [200.0 for _ in r["curve_steps"]]
        r["gns_b_simple_exact_at_target"] = math.nan if i == 5 else 250.0 + 150.0 * i
    found = analysis.analyse(results, n_test=600, target_val_loss=0.2, memory_budget_mb=None)
    figures = found.figures()
    assert figures["b_simple_exact_at_target"] == 550.0  # the median of 250, 400, 550, 700, 850
    assert figures["b_simple_estimate_over_exact"] == pytest.approx(200.0 / 550.0)  # the median of the ratios
    assert figures["b_simple_at_target"] == 200.0
    assert isinstance(found.fit, critical.Fit)
    assert figures["b_crit_over_b_simple_exact"] == pytest.approx(found.fit.b_crit / 550.0)
    text = report.write(found, tmp_path, _context())
    assert "B_simple = 550 exactly (median over the 5 experiments" in text
    assert f"masks counted as noise); B_crit / B_simple = {found.fit.b_crit / 550.0:.2f}. The" in text
    assert "{" not in text  # every placeholder filled
    assert "estimate there reads 200 (median, the median of estimate / exact 0.36, each reading against" in text
    # the exact value at the weights the reading measured, where the row has it, is what it is held to
    for r in results:
        r["gns_b_simple_exact_at_reading"] = 180.0
    like_with_like = analysis.analyse(results, 600, 0.2, None).figures()
    assert like_with_like["b_simple_estimate_over_exact"] == pytest.approx(200 / 180)


def test_a_figure_the_seeds_share_is_one_measurement_not_a_mean_plus_minus_zero(tmp_path: Path) -> None:
    # speed, step memory and peak RSS are the same for both seeds of a batch size (measured once),
    # F1 differs by seed: only F1 gets an interval
    results = [_result(b, seed) for b in (16, 64, 256) for seed in (0, 1)]
    found = analysis.analyse(results, n_test=600, target_val_loss=0.2, memory_budget_mb=None)
    row = found.rows[0]
    assert row["samples_per_s_mean"] == 4000.0 and math.isnan(row["samples_per_s_ci95"])
    assert math.isfinite(row["test_f1_macro_ci95"])
    text = report.write(found, tmp_path, _context())
    line = next(line for line in text.splitlines() if line.startswith("| **16** (best F1) |"))  # F1 ties: the first
    assert found.verdict.recommended == 256  # the fastest to the target: the table marks it
    assert sum(line.startswith("| **256** (recommended) |") for line in text.splitlines()) == 1
    assert "| 4000 | 0.132 |" in line and line.endswith("| 600 |")  # samples/s, step memory, peak RSS
    assert "0.9505 ± 0.0064" in line  # F1 keeps its interval
    assert "but samples/s, step memory (MiB), peak RSS (MiB): one measurement per batch size" in text


def test_seed_bands_are_the_t_interval_over_the_seeds_scored_at_each_step() -> None:
    from scipy import stats

    results = [_result(b, seed) for b in (16, 64) for seed in (0, 1, 2)]
    results[1] = {**results[1], "curve_val_loss": [math.nan, *results[1]["curve_val_loss"][1:]]}  # seed 1 unscored once
    bands = {band.batch_size: band for band in analysis.seed_bands(results)}
    assert sorted(bands) == [16, 64]
    band = bands[16]
    step = results[0]["curve_steps"][5]
    losses = [r["curve_val_loss"][5] for r in results[:3]]
    low, high = stats.t.interval(0.95, df=2, loc=sum(losses) / 3, scale=stats.sem(losses))
    i = band.examples.index(step * 16)
    assert band.mean[i] == pytest.approx(sum(losses) / 3, rel=1e-12)
    assert (band.low[i], band.high[i]) == (pytest.approx(low, rel=1e-12), pytest.approx(high, rel=1e-12))
    # the first step: seed 1 has no score there, so the interval is over seeds 0 and 2
    first = [results[0]["curve_val_loss"][0], results[2]["curve_val_loss"][0]]
    low, high = stats.t.interval(0.95, df=1, loc=sum(first) / 2, scale=stats.sem(first))
    assert (band.low[0], band.high[0]) == (pytest.approx(low, rel=1e-12), pytest.approx(high, rel=1e-12))


def test_the_headline_names_the_recommended_batch_and_why_in_two_lines() -> None:
    results = [_result(b, seed, f1=0.95 if b < 256 else 0.80) for b in (16, 64, 256) for seed in (0, 1, 2)]
    found = analysis.analyse(results, n_test=600, target_val_loss=0.2, memory_budget_mb=None)
    first, second = report.headline(found).strip().splitlines()
    verdict = found.verdict
    assert first.startswith(f"**Recommended: batch {verdict.recommended}**, the fastest to the target val loss")
    seconds = {r["batch_size"]: r["seconds_to_target_mean"] for r in found.rows}
    assert (verdict.best, verdict.recommended) == (16, 64)  # 16 and 64 tie in F1: the first is "best"
    assert verdict.speedup == pytest.approx(seconds[16] / seconds[64], rel=1e-12)
    assert f": {verdict.speedup:.1f}x faster to the target than batch 16, the highest in mean test F1" in first
    assert "at a test F1 +0.0000 ± 0.0000 against it (paired by seed)." in first  # the same F1 on every seed
    figures = found.figures()  # sweep.json: the price, for dvc exp show
    assert figures["recommended_speedup"] == verdict.speedup and figures["recommended_f1_minus_best"] == 0.0
    assert second.startswith("Beaten measurably in F1: 256 by 16, 64; critical batch size ")
    assert f"{found.fit.b_crit:.0f}" in second


def test_a_sweep_without_a_throughput_table_reads_its_clock_from_the_experiments_epochs(tmp_path: Path) -> None:
    """DDP/FSDP: each batch size's samples/s is the median of its experiments' (the slowest and fastest
    beside it), an adaptive row's left out; the report opens on how it trained and says what its clock is."""
    from batchlab.study import clock

    speeds = {16: [900.0, 1000.0, 1300.0], 64: [4000.0, 3000.0]}
    results = [{**_result(b, s), "samples_per_s": v} for b, vs in speeds.items() for s, v in enumerate(vs)]
    results.append({**_result(16, 9), "adaptive": True, "samples_per_s": 99.0})
    run = {"strategy": "fsdp", "nproc": 2, "nnodes": 1, "precision": "fp16", "grad_accum_steps": 2}
    epochs = clock.from_epochs(results, run)
    assert epochs["source"] == "epochs" and epochs["strategy"] == "fsdp"
    assert [
        (r["batch_size"], r["samples_per_s"], r["samples_per_s_low"], r["samples_per_s_high"], r["experiments"])
        for r in epochs["rows"]
    ] == [(16, 1000.0, 900.0, 1300.0, 3), (64, 3500.0, 3000.0, 4000.0, 2)]
    study = analysis.analyse([_result(b, s) for b in (16, 64) for s in (0, 1)], 100, None, None)
    context = {
        "run": run,
        "clock": epochs,
        "lr_scaling": "sqrt",
        "base_batch": 32,
        "optimizer": "adamw",
        "epochs": 4,
        "memory_budget_mb": None,
    }
    text = report.markdown(study, context)
    assert text.splitlines()[2] == (
        "Trained with train.strategy fsdp on 2 processes (1 machine(s)), precision fp16, 2 accumulation steps a batch."
    )
    assert "## The clock: each experiment's epochs" in text and "| 16 | 1000 | 900–1300 | 3 |" in text
    assert "throughput side by side" not in text
