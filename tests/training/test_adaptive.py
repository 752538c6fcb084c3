"""train.adaptive_batch: the rule against its closed form, a schedule that must grow and one that
must not, exact resume, DDP against one process, and the bad keys."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from scipy.optimize import brentq

from batchlab import atomic
from batchlab.config import ConfigError
from batchlab.data import Dataset
from batchlab.paths import Paths
from batchlab.sweep import speeds
from batchlab.training.adaptive import BatchSchedule, gain_of_growing, lower_bound
from batchlab.training.strategy import Strategy
from batchlab.training.throughput import Table
from batchlab.training.train import fit
from tests.support import run, set_params, tiny_config
from tests.support.models import BATCHNORM

CPU = Strategy(torch.device("cpu"))
GROWS = {"epochs": 8, "batch_size": 8, "adaptive_batch": True, "adapt_rule": "statistical", "adapt_every_examples": 160}


def _grow_ratio(threshold: float) -> float:
    """B_noise / B above which doubling B saves more than `threshold` of S/S_min + E/E_min,
    solved numerically from the cost 2 + r + 1/r against 2 + r/2 + 2/r (r = B_noise / B)."""
    return float(brentq(lambda r: (r / 2 - 1 / r) / (2 + r + 1 / r) - threshold, 1.0, 100.0))


def test_the_batch_doubles_exactly_when_the_cost_says_so() -> None:
    assert _grow_ratio(0.0) == pytest.approx(math.sqrt(2))  # at threshold 0: B_noise > sqrt(2) B
    for threshold in (0.0, 0.05, 0.2):
        ratio = _grow_ratio(threshold)
        for batch in (8, 64):
            below = BatchSchedule(batch, 10_000, 10, threshold, 1, "sqrt")
            assert below.decide(10, 80, batch * ratio * 0.999) is None and below.batch == batch
            above = BatchSchedule(batch, 10_000, 10, threshold, 1, "sqrt")
            assert above.decide(10, 80, batch * ratio * 1.001) == pytest.approx(math.sqrt(2))
            assert above.batch == 2 * batch
    assert gain_of_growing(16, 32.0) == pytest.approx((2 + 2 + 0.5 - (2 + 1 + 1)) / (2 + 2 + 0.5))


def test_a_change_is_held_at_the_cap_and_without_a_reading() -> None:
    capped = BatchSchedule(64, 100, 10, 0.05, 1, "linear")
    assert capped.decide(10, 640, 1e6) is None and capped.batch == 64
    assert "above the cap 100" in capped.decisions[-1]["reason"]
    blind = BatchSchedule(64, 1000, 10, 0.05, 1, "linear")
    assert blind.decide(10, 640, math.nan) is None and "no noise-scale reading" in blind.decisions[-1]["reason"]


class _StopAfterEpoch:
    """Interrupts training like Ctrl-C once `epochs` epochs were logged (not on the schedule's own points)."""

    run_id = None

    def __init__(self, epochs: int) -> None:
        self.epochs = epochs

    def log_epoch(self, metrics: Mapping[str, float], step: int) -> None:
        if "val_loss" in metrics and step > self.epochs:
            raise KeyboardInterrupt


def _examples_at(step: int, changes: list[dict[str, float]], start: int) -> int:
    """Examples seen after `step` steps: each stretch's steps x its batch."""
    seen, at, batch = 0, 0, start
    for change in changes:
        if change["step"] >= step:
            break
        seen, at, batch = seen + (change["step"] - at) * batch, change["step"], change["to"]
    return seen + (step - at) * batch


def test_a_rising_noise_scale_grows_the_batch_and_the_lr_follows(tiny_dataset: Dataset) -> None:
    result = fit(tiny_config(train={**GROWS, "eval_every_steps": 10}), tiny_dataset, CPU)
    changes = [d for d in result.batch_schedule if d["to"] != d["from"]]
    assert len(changes) >= 2, result.batch_schedule
    ratio = _grow_ratio(0.05)
    for decision in result.batch_schedule:  # every decision is the rule's on its reading's lower bound
        grew = decision["to"] == 2 * decision["from"]
        assert decision["b_noise_low"] == lower_bound(decision["b_noise"], decision["b_noise_se"])
        assert grew == (decision["b_noise_low"] > ratio * decision["from"]), decision
        assert decision["examples"] == _examples_at(decision["step"], changes, 8)
    readings = [d["b_noise"] for d in result.batch_schedule]
    assert readings[-1] > 10 * readings[0]  # the noise scale rose: why the batch grew
    batches = [row["batch_size"] for row in result.history]
    assert batches == sorted(batches) and batches[-1] == changes[-1]["to"]
    # the val curve's examples (the study's steps-vs-examples) follow the batch of each stretch
    assert [p["examples"] for p in result.val_curve] == [
        _examples_at(int(p["step"]), changes, 8) for p in result.val_curve
    ]
    # the lr: the warmup + cosine in examples, sqrt-rescaled at each change
    expected = _epoch_end_lrs(tiny_dataset.train.y.shape[0], 8, 8, changes, tiny_config().train.lr)
    assert [row["lr"] for row in result.history] == pytest.approx(expected, rel=1e-6)


def _epoch_end_lrs(n_train: int, epochs: int, start: int, changes: list[dict[str, float]], base: float) -> list[float]:
    """The lr after each epoch, stepped as the schedule is meant to: per example, warmup over the
    starting batch's first epoch, a cosine to the starting batch's `epochs` epochs, x sqrt(ratio)
    from each change on."""
    steps0 = n_train // start
    warmup, total = steps0 * start, epochs * steps0 * start
    pending, step, seen, batch, scale, lr, out = list(changes), 0, 0, start, 1.0, base, []
    for _ in range(epochs):
        used = 0
        while used + batch <= n_train:
            used, step, seen = used + batch, step + 1, seen + batch
            if seen < warmup:
                factor = (seen + batch) / warmup
            else:
                factor = 0.5 * (1 + math.cos(math.pi * min(1.0, (seen - warmup) / (total - warmup))))
            lr = base * scale * factor
            if pending and pending[0]["step"] == step:
                ratio = math.sqrt(pending[0]["to"] / batch)
                scale, lr, batch = scale * ratio, lr * ratio, int(pending.pop(0)["to"])
        out.append(lr)
    return out


def test_a_noise_scale_below_the_batch_holds_it_and_trains_as_the_fixed_batch(tiny_dataset: Dataset) -> None:
    """Early in training |G|² is large: B_noise (~10 here) stays well below 64 for the first
    epochs, so nothing changes, and the run is the fixed-batch run, weight for weight (the
    schedule in examples gives the per-step schedule's factors exactly)."""
    train = {"epochs": 2, "batch_size": 64}
    adaptive = {"adaptive_batch": True, "adapt_rule": "statistical", "adapt_every_examples": 128}
    held = fit(tiny_config(train={**train, **adaptive}), tiny_dataset, CPU)
    assert len(held.batch_schedule) >= 6 and all(d["to"] == 64 for d in held.batch_schedule)
    assert all(d["b_noise"] < 64 for d in held.batch_schedule if math.isfinite(d["b_noise"]))
    fixed = fit(tiny_config(train=train), tiny_dataset, CPU)
    want, got = fixed.model.state_dict(), held.model.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert [r["lr"] for r in held.history] == [r["lr"] for r in fixed.history]


def test_an_interrupted_adaptive_run_resumes_to_the_uninterrupted_weights(
    tiny_dataset: Dataset, tmp_path: Path
) -> None:
    cfg = tiny_config(model={"dropout": 0.2}, train=GROWS)
    expected = fit(cfg, tiny_dataset, CPU)
    checkpoint = tmp_path / "ckpt.pt"
    with pytest.raises(KeyboardInterrupt):
        fit(cfg, tiny_dataset, CPU, tracker=_StopAfterEpoch(3), checkpoint=checkpoint)  # type: ignore[arg-type]
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["state"]["batch_schedule"]["batch"] > 8  # it had grown before the interruption
    resumed = fit(cfg, tiny_dataset, CPU, checkpoint=checkpoint)
    assert resumed.batch_schedule == expected.batch_schedule
    want, got = expected.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("max_batch_size", 16, "train.max_batch_size (16) is below train.batch_size (32)"),
        ("adapt_every_examples", 0, "train.adapt_every_examples: Input should be greater than 0"),
        ("adapt_step_time", [1e-4], "train.adapt_step_time must be [a, b]"),
        ("gns", False, "train.adaptive_batch reads the measured noise scale: set train.gns: true"),
        ("strategy", "fsdp", "train.adaptive_batch needs the noise probe, which FSDP has not: use single or ddp"),
    ],
)
def test_bad_adaptive_keys_are_one_line_naming_the_key(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        tiny_config(train={"adaptive_batch": True, key: value})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_batchnorm_model_says_why_it_cannot_adapt(
    tiny_dataset: Dataset, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "normed_for_adaptive.py").write_text(BATCHNORM)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tiny_config(model={"factory": "normed_for_adaptive:build", "kwargs": {"width": 8}},
                      train={"adaptive_batch": True})  # fmt: skip
    with pytest.raises(ConfigError, match=r"^train.adaptive_batch reads the noise scale, which is not measured"):
        fit(cfg, tiny_dataset, CPU)


@pytest.mark.integration
def test_ddp_takes_the_single_process_schedule_to_the_same_weights(repo_copy: Path) -> None:
    """Two gloo ranks read the same noise scale (the probe all-reduces, the norms are global), so
    they take the single process's decisions, each rank half of every batch."""
    set_params(repo_copy, "train", adaptive_batch=True, batch_size=8, adapt_rule="statistical",
               adapt_every_examples=160, epochs=6, threads=1)  # fmt: skip
    run(["batchlab", "generate"], repo_copy)
    run(["batchlab", "train"], repo_copy)
    single = torch.load(repo_copy / "models/model.pt", weights_only=True)["state_dict"]
    schedule = json.loads((repo_copy / "reports/train_summary.json").read_text())["batch_schedule"]
    set_params(repo_copy, "train", strategy="ddp", nproc=2)
    set_params(repo_copy, "tracking", enabled=True)
    out = run(["batchlab", "train"], repo_copy)
    ddp = torch.load(repo_copy / "models/model.pt", weights_only=True)["state_dict"]
    ddp_schedule = json.loads((repo_copy / "reports/train_summary.json").read_text())["batch_schedule"]
    assert [(d["step"], d["to"]) for d in ddp_schedule] == [(d["step"], d["to"]) for d in schedule]
    assert sum(d["to"] != d["from"] for d in schedule) >= 2, schedule
    assert max((single[k] - ddp[k]).abs().max().item() for k in single) < 1e-5
    assert out.stderr.count("adaptive batch schedule: 8 -> 16") == 1  # rank 0 alone reports it
    # MLflow: the batch and lr at step 0 and at each change, and the decisions as a table
    client = MlflowClient(f"sqlite:///{repo_copy / 'mlflow.db'}")
    run_id = json.loads((repo_copy / "reports/train.json").read_text())["run_id"]
    changes = [d for d in ddp_schedule if d["to"] != d["from"]]
    batches = client.get_metric_history(run_id, "adaptive.batch_size")
    assert [(m.step, m.value) for m in batches] == [(0, 8.0)] + [(d["step"], float(d["to"])) for d in changes]
    assert [m.step for m in client.get_metric_history(run_id, "adaptive.lr")] == [m.step for m in batches]
    table = json.loads(Path(client.download_artifacts(run_id, "batch_schedule.json")).read_text())
    to = table["columns"].index("to")
    assert [row[to] for row in table["data"]] == [d["to"] for d in ddp_schedule]
    history = (repo_copy / "reports/history.csv").read_text().splitlines()
    assert "batch_size" in history[0].split(",")


@pytest.mark.integration
def test_the_studys_adaptive_row_is_scipys_paired_test_of_the_result_rows(tmp_path: Path) -> None:
    """sweep.adaptive end to end in one process: the report's paired differences and p-values are
    recomputed here from the result.json rows (scipy's ttest_rel and t interval), and the verdict's
    "measurable" marks are Holm's over all of them."""
    from scipy import stats

    from batchlab import stages
    from batchlab.study import analysis
    from batchlab.sweep.run import run_sweep

    cfg = tiny_config(
        sweep={"batch_sizes": [8, 32, 128], "seeds": [0, 1, 2], "epochs": 6, "adaptive": True},
        train={"adapt_every_examples": 80, "adapt_rule": "statistical"},
    )
    stages.generate(cfg, Paths(tmp_path))
    run_sweep(cfg, Paths(tmp_path))
    rows = [json.loads(p.read_text()) for p in sorted((tmp_path / "sweep/experiments").glob("*/result.json"))]
    adaptive = [r for r in rows if r["adaptive"]]
    assert [r["name"] for r in adaptive] == ["adaptive-seed0", "adaptive-seed1", "adaptive-seed2"]
    assert all(any(d["to"] > d["from"] for d in r["batch_schedule"]) for r in adaptive)  # each one grew
    study = analysis.analyse(rows, 90, None, None)
    assert study.adaptive is not None and [r["batch_size"] for r in study.rows] == [8, 32, 128]
    p_values = []
    for batch in (8, 32, 128):
        fixed = {r["seed"]: r for r in study.results if r["batch_size"] == batch}
        for figure in ("test_f1_macro", "seconds_to_target", "steps_to_target"):
            a = [r[figure] for r in sorted(study.adaptive.results, key=lambda r: r["seed"])]
            f = [fixed[seed][figure] for seed in (0, 1, 2)]
            diffs = [x - y for x, y in zip(a, f, strict=True)]
            got = study.adaptive.against(batch, figure)
            assert got.diff_mean == pytest.approx(sum(diffs) / 3, rel=1e-12, abs=1e-12)
            half = stats.t.ppf(0.975, 2) * stats.tstd(diffs) / math.sqrt(3)
            assert got.diff_ci95 == pytest.approx(half, rel=1e-9)
            if len(set(diffs)) > 1:
                assert got.p_value == pytest.approx(stats.ttest_rel(a, f).pvalue, rel=1e-9)
        p_values += [c.p_value for c in study.adaptive.comparisons if c.batch_size == batch]
    # Holm over every comparison (scipy's false_discovery_control has no Holm: statsmodels' rule by hand)
    ordered = sorted(p for p in p_values if math.isfinite(p))
    m, cut = len(p_values), 0
    while cut < len(ordered) and ordered[cut] <= 0.05 / (m - cut):
        cut += 1
    assert sum(c.measurable for c in study.adaptive.comparisons) == cut
    # its seconds: each epoch's rows at the throughput table's speed for its batch, plus each probe
    # it took at the table's seconds per probe (it decides on them), up to the examples that reached it
    table = Table.from_dict(json.loads((tmp_path / "sweep" / speeds.TABLE).read_text()))
    assert {e.batch_size for e in table.entries} == {8, 16, 32, 64, 128} and table.probe_seconds > 0
    for r in study.adaptive.results:
        history = atomic.read_csv(tmp_path / "sweep/experiments" / r["name"] / "reports/history.csv")
        probes = [0.0] + [float(h["gns.probes"]) for h in history]
        assert probes[-1] >= sum(1 for d in r["batch_schedule"] if math.isfinite(d["b_noise"]))  # one a decision
        expected, total = [], 0.0
        for i, h in enumerate(history):
            rows = round(float(h["samples_per_s"]) * float(h["epoch_seconds"]))
            total += rows / table.samples_per_s(int(float(h["batch_size"])))
            total += (probes[i + 1] - probes[i]) * table.probe_seconds
            expected.append(total)
        assert r["epoch_train_seconds"] == pytest.approx(expected, rel=1e-9)
        i = next(k for k, e in enumerate(r["epoch_examples"]) if e >= r["examples_to_target"])
        assert r["seconds_to_target"] <= r["epoch_train_seconds"][i]
        assert i == 0 or r["seconds_to_target"] > r["epoch_train_seconds"][i - 1]
    report = (tmp_path / "reports/sweep/summary.md").read_text()
    assert "## Adaptive batch size" in report and f"all {len(p_values)} comparisons" in report
    from batchlab.study.report import headline

    assert headline(study).splitlines()[-1].startswith("Adaptive batch: Against the fastest fixed batch (")


def test_the_studys_adaptive_cap_is_the_largest_batch_within_the_memory_budget(tiny_dataset: Dataset) -> None:
    from batchlab.sweep import plan

    cfg = tiny_config(sweep={"batch_sizes": [8, 32, 128], "adaptive": True})
    n_train = tiny_dataset.train.y.shape[0]
    shape = (tiny_dataset.input_shape, tiny_dataset.n_classes, tiny_dataset.vocab)
    mib = {b: plan.step_mib(cfg, b, n_train, shape) for b in (8, 32, 128)}
    assert mib[8] < mib[32] < mib[128]
    for budget, cap in (((mib[32] + mib[128]) / 2, 32), (mib[128] * 2, 128), (mib[8] / 2, 8)):
        budgeted = tiny_config(sweep={"batch_sizes": [8, 32, 128], "adaptive": True, "memory_budget_mb": budget})
        planned = [e for e in plan.plan(budgeted, n_train, tiny_dataset) if e.adaptive]
        assert {e.max_batch_size for e in planned} == {cap} and {e.batch_size for e in planned} == {8}
        assert plan.experiment_config(budgeted, planned[0]).train.max_batch_size == cap
