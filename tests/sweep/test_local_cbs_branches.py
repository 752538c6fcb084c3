"""sweep.local_cbs end to end on real training: a branch continues the run it came from, a problem
without gradient noise gives the answer the lr rule implies, and the sweep reports, stores and
reuses the branches; bad keys get one line naming the key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from batchlab import atomic, stages
from batchlab.config import ConfigError, parse_config
from batchlab.data import Dataset, Split, build
from batchlab.paths import Paths
from batchlab.seeds import branches as seeds_branches
from batchlab.seeds import vectorized
from batchlab.seeds.branches import branch_losses
from batchlab.study import local_cbs
from batchlab.sweep import branches, executors, plan, tasks
from batchlab.sweep.lock import exclusive
from batchlab.sweep.run import prepare, run_prepared, run_sweep
from batchlab.training.branch import branch_loss
from batchlab.training.strategy import session
from batchlab.training.train import fit
from tests.support import TINY, merge, tiny_config


def _noiseless(rows: int = 256) -> Dataset:
    """Every row the same: each batch's gradient is the full split's, whatever its size."""
    x = np.tile(np.linspace(-1, 1, 8, dtype=np.float32), (rows, 1))
    y = np.zeros(rows, dtype=np.int64)
    split = Split(x, y)
    return Dataset(split, Split(x[:32], y[:32]), Split(x[:32], y[:32]), [f"f{i}" for i in range(8)], ["a", "b"])


def test_the_base_branch_continues_the_run_it_branches_from(tiny_dataset: Dataset, tmp_path: Path) -> None:
    """Multiplier 1 from epoch 1's checkpoint over two epochs' rows is the run's epochs 2 and 3:
    the same weights, optimizer state, schedule position and rows (no dropout, whole batches)."""
    cfg = tiny_config(train={"batch_size": 20, "epochs": 4})  # 420 train rows: 21 whole batches an epoch
    n = tiny_dataset.train.y.shape[0]
    assert n % 20 == 0
    with session(cfg.train) as strategy:
        fit(cfg, tiny_dataset, strategy, checkpoint=tmp_path / "train.pt", until=1)
    saved = torch.load(tmp_path / "train.pt", weights_only=True)
    with session(cfg.train) as strategy:
        run = fit(cfg, tiny_dataset, strategy, checkpoint=tmp_path / "train.pt", until=3)
    assert branch_loss(cfg, tiny_dataset, saved, 1, 2 * n) == run.history[-1]["val_loss"]
    assert branch_loss(cfg, tiny_dataset, saved, 2, 2 * n) != run.history[-1]["val_loss"]


def _together(cfg: Any, dataset: Dataset) -> bool:
    """The sweep's one answer (run.prepare asks it once): whether these seeds train together."""
    return vectorized.sweep_trains_apart(cfg, lambda: dataset) is None


@pytest.mark.parametrize(("rule", "expected"), [("sqrt", (1, 1, 1)), ("linear", (8, 8, 8))])
def test_without_gradient_noise_the_lr_rule_sets_the_local_cbs(workdir: Path, rule: str, expected: tuple) -> None:
    """No noise: a k-times batch takes 1/k of the steps on the same gradient. At √k the lr it falls
    ~1/√k as far (2x keeps 71% < 90% of the base branch's fall: the run's own batch is the CBS); at
    k the lr a small step's progress is the same (every multiplier within)."""
    cfg = tiny_config(
        model={"hidden_sizes": [8], "dropout": 0.0},
        train={"batch_size": 8, "epochs": 4, "optimizer": "sgd", "momentum": 0.0, "weight_decay": 0.0,
               "schedule": "constant", "lr": 0.02},
        sweep={"seeds": [0, 1, 2, 3, 4], "lr_scaling": rule, "local_cbs": True, "local_cbs_points": [0.5],
               "local_cbs_multipliers": [1, 2, 4, 8], "local_cbs_fraction": 0.25},
    )  # fmt: skip
    dataset = _noiseless()
    raw = branches.run(cfg, Paths(workdir), dataset, _together(cfg, dataset))
    (point,) = local_cbs.points_of(raw, cfg.sweep.local_cbs_tolerance)
    r = point.result
    assert point.epoch == 2 and r.measured and (r.multiplier, r.low, r.high) == expected, r
    assert abs(point.b_simple_exact) < 1e-5  # no noise indeed (float rounding only)


def test_five_seeds_of_real_branches_agree_with_fifty_seeds_brute_force_within_the_interval(workdir: Path) -> None:
    """The issue's truth check on real training (the simulation's is in tests/study/test_local_cbs.py):
    50 seeds branched together from epoch 1 of a small problem give the brute-force local CBS;
    the 5-seed interval of 300 random draws of 5 of those seeds holds it in ≥ 90% of them. The
    problem is chosen so the answer is inside the grid (2x within, 4x measurably worse at 50 seeds)
    and the 5-seed answers differ from draw to draw: neither end of the grid covers by itself."""
    cfg = tiny_config(
        train={"epochs": 4, "batch_size": 16, "lr": 0.01},
        sweep={"epochs": 4, "seeds": list(range(50)), "local_cbs": True, "local_cbs_points": [0.25],
               "local_cbs_multipliers": [1, 2, 4, 8], "local_cbs_fraction": 0.25, "lr_scaling": "linear"},
    )  # fmt: skip
    dataset = build(cfg.data)[0]
    (point,) = branches.run(cfg, Paths(workdir), dataset, _together(cfg, dataset))
    ks, tolerance = point["multipliers"], cfg.sweep.local_cbs_tolerance
    brute = local_cbs.estimate(point["start"], point["losses"], ks, tolerance)
    assert brute.measured and 1 < brute.multiplier < ks[-1], brute
    rng = np.random.default_rng(0)
    draws = [rng.choice(50, 5, replace=False) for _ in range(300)]
    five = [local_cbs.estimate([point["start"][i] for i in d], [point["losses"][i] for i in d], ks, tolerance)
            for d in draws]  # fmt: skip
    covered = sum(e.low <= brute.multiplier <= e.high for e in five) / len(five)
    assert covered >= 0.9, covered
    assert len({e.multiplier for e in five}) > 1  # the 5-seed answer moves with the seeds drawn


def test_the_branches_run_ignores_early_stopping_as_the_studys_experiments_do(workdir: Path) -> None:
    """lr 1e-30 (below float32 resolution: the weights never move): the val loss never improves, so
    patience 1 would stop `batchlab train` after its second epoch; the study's experiments train
    every epoch (identical conditions), and so does the branches' run: the point at epoch 3 is
    branched from epoch 3's weights."""
    cfg = tiny_config(
        train={"epochs": 4, "lr": 1e-30, "early_stopping_patience": 1},
        sweep={"epochs": 4, "seeds": [0, 1], "local_cbs": True, "local_cbs_points": [0.75],
               "local_cbs_multipliers": [1, 2]},
    )  # fmt: skip
    dataset = _noiseless(128)
    with session(cfg.train) as strategy:
        assert len(fit(cfg, dataset, strategy).history) == 2  # a plain training stops early
    (point,) = branches.run(cfg, Paths(workdir), dataset, _together(cfg, dataset))
    assert point["epoch"] == 3 and point["examples"] == 3 * 128
    for seed in (0, 1):
        saved = torch.load(workdir / f"sweep/local_cbs/seed{seed}/epoch-3.pt", weights_only=True)
        assert saved["state"]["epoch"] == 3
    assert not local_cbs.points_of([point], cfg.sweep.local_cbs_tolerance)[0].result.measured  # no fall


@pytest.mark.parametrize("together", [True, False])
def test_an_interrupted_seed_resumes_at_its_first_unfinished_point(
    workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, together: bool
) -> None:
    """Stopped in the second point (the seeds together: both seeds'; apart: seed 1's): a rerun
    trains none of the finished points' branches again and gives every figure an unbroken run gives."""
    cfg = tiny_config(
        train={"epochs": 4},
        sweep={"epochs": 4, "seeds": [0, 1], "local_cbs": True, "local_cbs_points": [0.25, 0.5],
               "local_cbs_multipliers": [1, 2], "vectorize_seeds": together},
    )  # fmt: skip
    dataset = _noiseless(128)
    unbroken = branches.run(cfg, Paths(tmp_path / "unbroken"), dataset, _together(cfg, dataset))
    calls: list[int] = []
    trains: Any = branch_losses if together else branch_loss  # the seeds' branches at once, or a seed's

    def counted(*args: Any) -> Any:
        calls.append(int(args[3]))
        if stop_at is not None and len(calls) == stop_at:
            raise KeyboardInterrupt
        return trains(*args)

    monkeypatch.setattr(seeds_branches, trains.__name__, counted)  # where the branches train
    # together: the first point's two multipliers, then the second's first; apart: seed 0's two
    # points, seed 1's first, then seed 1's second starts
    stop_at: int | None = 2 + 1 if together else 2 * 2 + 2 + 1
    with pytest.raises(KeyboardInterrupt):
        branches.run(cfg, Paths(workdir), dataset, _together(cfg, dataset))
    for seed in (1,) if not together else (0, 1):
        stored = json.loads((workdir / f"sweep/local_cbs/seed{seed}/branches.json").read_text())
        assert [p["epoch"] for p in stored["points"]] == [1]
    calls.clear()
    stop_at = None
    assert branches.run(cfg, Paths(workdir), dataset, _together(cfg, dataset)) == unbroken
    assert calls == [1, 2]  # the second point only (apart: seed 1's)


@pytest.mark.integration
def test_a_sweep_with_local_cbs_reports_stores_and_reuses_its_branches(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    cfg = tiny_config(
        tracking={"enabled": True, "experiment": "local-cbs", "registered_model": "", "tracking_uri": uri},
        train={"epochs": 4, "adapt_rule": "schedule"},
        sweep={"epochs": 4, "seeds": [0, 1, 2], "local_cbs": True, "local_cbs_multipliers": [1, 2, 4],
               "local_cbs_points": [0.25, 0.5], "adaptive": True},
    )  # fmt: skip
    paths = Paths(workdir)
    stages.generate(cfg, paths)
    summary = run_sweep(cfg, paths)
    folder = workdir / "reports/sweep"
    stored = json.loads((workdir / "sweep/local_cbs/seed0/branches.json").read_text())
    assert [p["epoch"] for p in stored["points"]] == [1, 2] and len(stored["points"][0]["losses"]) == 3
    assert (workdir / "sweep/local_cbs/seed0/epoch-1.pt").is_file()  # the branch point, in the resume format
    points = local_cbs.points_of(
        branches.run(cfg, paths, stages_dataset(paths), _together(cfg, stages_dataset(paths))), 0.1
    )
    text = (folder / "summary.md").read_text()
    assert "## The local critical batch size through training" in text
    assert local_cbs.section(points, 0.1, None).splitlines()[6] in text  # the first point's row, as computed
    warmup = local_cbs.schedule(points)  # the adaptive row's schedule rule follows CBS(t), measured first
    assert f"`train.adapt_schedule: [{', '.join(f'[{s:g}, {b}]' for s, b in warmup)}]`" in text
    for seed in (0, 1, 2):  # each epoch's batch: the largest doubling of 16 up to the schedule's there (cap 64)
        history = atomic.read_csv(workdir / f"sweep/experiments/adaptive-seed{seed}/reports/history.csv")
        wanted = [max(b for b in (16, 32, 64) if b <= max([16] + [b for s, b in warmup if s <= i / 4]))
                  for i in range(4)]  # fmt: skip
        assert [int(float(h["batch_size"])) for h in history] == wanted
    metrics = json.loads((folder / "sweep.json").read_text())
    assert metrics["local_cbs.p25.cbs"] == points[0].result.multiplier * 32 == summary["local_cbs.p25.cbs"]
    rows = (folder / "local_cbs.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * 3 and rows[0].startswith("fraction,epoch,batch,multiplier")
    assert (folder / "local_cbs.png").stat().st_size > 0
    client = MlflowClient(uri)
    (parent,) = client.search_runs([client.get_experiment_by_name("local-cbs").experiment_id], "tags.sweep = 'parent'")
    assert parent.data.tags["study.local_cbs.p25.cbs"] == f"{metrics['local_cbs.p25.cbs']:.4g}"
    logged = {a.path for a in client.list_artifacts(parent.info.run_id, "sweep")}
    assert {"sweep/local_cbs.csv", "sweep/local_cbs.png"} <= logged

    def refuse(*args: object) -> float:
        raise AssertionError("a rerun trained a branch again")

    monkeypatch.setattr(seeds_branches, "branch_loss", refuse)
    again = run_sweep(cfg, paths)
    assert again["local_cbs.p25.cbs"] == summary["local_cbs.p25.cbs"]


@pytest.mark.integration
def test_each_seeds_branches_are_a_work_item_run_in_the_lanes(workdir: Path, tmp_path: Path) -> None:
    """sweep.parallel 2: the executor gets the seeds' branches as one work item (they train
    together), queued first, and runs it in a lane's process; the stored points equal branches
    trained in this process."""
    cfg = tiny_config(
        train={"epochs": 4},
        sweep={"epochs": 4, "seeds": [0, 1], "parallel": 2, "local_cbs": True, "local_cbs_points": [0.25, 0.5],
               "local_cbs_multipliers": [1, 2]},
    )  # fmt: skip
    paths = Paths(workdir)
    stages.generate(cfg, paths)
    given: list[str] = []

    def observed(lane: tasks.Lane, work: list[tasks.Work]) -> tasks.Results:
        given.extend(item.name for item in work)
        return executors.run_local(lane, work)

    observing = executors.Executor("local", observed)
    with exclusive(paths):
        summary = run_prepared(cfg, paths, observing, prepare(cfg, paths, observing))
    # the clock first, then the branches queued ahead of the experiments, the truth last
    assert given[:2] == ["clock", "local-cbs-seed0+seed1"] and not any("local-cbs" in name for name in given[2:])
    here = Paths(tmp_path)
    stages.generate(cfg, here)
    in_process = branches.run(cfg, here, stages_dataset(here), _together(cfg, stages_dataset(here)))
    in_lanes = branches.run(
        cfg, paths, stages_dataset(paths), _together(cfg, stages_dataset(paths))
    )  # read back: nothing trains
    for a, b in zip(in_lanes, in_process, strict=True):
        assert a["epoch"] == b["epoch"] and np.allclose(a["losses"], b["losses"], rtol=1e-6, atol=0)
    points = local_cbs.points_of(in_lanes, cfg.sweep.local_cbs_tolerance)
    assert summary["local_cbs.p25.cbs"] == points[0].result.multiplier * 32


def stages_dataset(paths: Paths) -> Dataset:
    from batchlab import data

    return data.load(paths.data)


@pytest.mark.parametrize(
    ("sweep", "says"),
    [
        ({"local_cbs_points": [0.5, 1.0]}, "local_cbs_points"),
        ({"local_cbs_points": [0.0]}, "local_cbs_points"),
        ({"local_cbs_multipliers": [2, 4]}, "sweep.local_cbs_multipliers must list 1"),
        ({"local_cbs_fraction": 0}, "local_cbs_fraction"),
    ],
)
def test_bad_local_cbs_keys_are_named(sweep: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        parse_config(merge(TINY, {"sweep": {"local_cbs": True, **sweep}}))


def test_a_branch_larger_than_the_train_split_is_refused_naming_the_key(workdir: Path) -> None:
    cfg = tiny_config(sweep={"local_cbs": True, "local_cbs_multipliers": [1, 2, 32]})  # 32 x 32 rows > 420
    stages.generate(cfg, Paths(workdir))
    with pytest.raises(ConfigError, match=r"sweep.local_cbs_multipliers \[32\] make branches larger than the train"):
        run_sweep(cfg, Paths(workdir))


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"sweep": {"epochs": 1}}, r"^sweep.local_cbs branches at an epoch's end inside the run: it needs sweep"),
        ({"train": {"precision": "fp16"}}, r"^sweep.local_cbs branches without fp16's grad scaler: set train"),
    ],
)
def test_a_study_the_branches_cannot_measure_is_refused_in_one_line(workdir: Path, params: dict, says: str) -> None:
    cfg = tiny_config(**merge({"sweep": {"local_cbs": True, "local_cbs_multipliers": [1, 2]}}, params))
    stages.generate(cfg, Paths(workdir))
    with pytest.raises(ConfigError, match=says):
        run_sweep(cfg, Paths(workdir))


def test_multipliers_whose_step_passes_the_memory_budget_are_not_branched(tiny_dataset: Dataset) -> None:
    shape = (tiny_dataset.input_shape, tiny_dataset.n_classes, tiny_dataset.vocab)
    cfg = tiny_config(sweep={"local_cbs": True, "local_cbs_multipliers": [1, 2, 4, 8]})
    mib = {k: plan.step_mib(cfg, 32 * k, 420, shape) for k in (2, 4)}
    assert mib[2] < mib[4]
    budget = (mib[2] + mib[4]) / 2
    grid = {"local_cbs": True, "local_cbs_multipliers": [1, 2, 4, 8]}
    cfg = tiny_config(sweep={**grid, "memory_budget_mb": budget})
    assert branches.multipliers(cfg, tiny_dataset) == [1, 2]
    tight = tiny_config(sweep={**grid, "memory_budget_mb": mib[2] / 2})
    with pytest.raises(ConfigError, match=r"memory_budget_mb .* fits no branch batch above train.batch_size"):
        branches.multipliers(tight, tiny_dataset)


def test_the_schedule_rule_in_a_sweep_needs_the_local_cbs_or_a_schedule(tiny_dataset: Dataset) -> None:
    cfg = tiny_config(train={"adapt_rule": "schedule"}, sweep={"adaptive": True})
    experiments = plan.plan(cfg, tiny_dataset.train.y.shape[0], tiny_dataset)
    with pytest.raises(ConfigError, match=r"^sweep.adaptive with train.adapt_rule schedule .* set sweep.local_cbs"):
        plan.needs_schedule(experiments, cfg)
    given = tiny_config(train={"adapt_rule": "schedule", "adapt_schedule": [[0.5, 64]]}, sweep={"adaptive": True})
    assert not plan.needs_schedule(experiments, given)  # the user's own schedule: no branching needed
    assert plan.experiment_config(given, experiments[-1]).train.adapt_schedule == [(0.5, 64)]
    with pytest.raises(ConfigError, match=r"^sweep.local_cbs measured no point"):
        plan.with_schedule(experiments, [])


def test_the_adaptive_row_is_keyed_without_the_settings_its_rule_does_not_read(tiny_dataset: Dataset) -> None:
    """A train.adapt_schedule left in params under the time rule (or a step time under the schedule
    rule) does not change the adaptive row's key: no retrain for a setting it ignores."""
    n, data_hash = tiny_dataset.train.y.shape[0], tiny_dataset.content_hash()
    for rule, ignored, read in [("time", {"adapt_schedule": [[0.5, 64]]}, {"adapt_step_time": [1e-3, 1e-5]}),
                                ("schedule", {"adapt_step_time": [1e-3, 1e-5]}, {"adapt_schedule": [[0.5, 64]]}),
                                ("statistical", {"adapt_schedule": [[0.5, 64]], "adapt_step_time": [1e-3, 1e-5]},
                                 {"adapt_threshold": 0.2})]:  # fmt: skip
        base = {"adapt_rule": rule, "adapt_schedule": [[0.25, 32]]} if rule == "schedule" else {"adapt_rule": rule}
        keys = []
        for extra in ({}, ignored, read):
            cfg = tiny_config(train={**base, **extra}, sweep={"adaptive": True})
            adaptive = plan.plan(cfg, n, tiny_dataset)[-1]
            assert adaptive.adaptive
            keys.append(plan.keyed(cfg, adaptive, data_hash).key)
        assert keys[0] == keys[1] != keys[2], rule
