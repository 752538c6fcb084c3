"""The batch-size sweep against a real MLflow backend (SQLite) and real training."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from mlflow import MlflowClient

from batchlab import atomic, stages, tracking
from batchlab.config import ConfigError
from batchlab.paths import Paths
from batchlab.sweep import executors, experiment
from batchlab.sweep import plan as sweep_plan
from batchlab.sweep.lock import exclusive
from batchlab.sweep.plan import experiment_config, folder_of, plan
from batchlab.sweep.run import finish, origin_tags, prepare, run_sweep
from batchlab.sweep.tasks import Lane
from batchlab.training import throughput
from batchlab.training.curve_weights import CurveWeights
from batchlab.training.optim import scaled_lr
from batchlab.training.train import initial_model
from tests.support import TINY, env_with_venv, merge, run, tiny_config, wait_until, write_params

TRACK = {"enabled": True, "experiment": "sweep-test", "registered_model": ""}


def test_lr_scaling_rules() -> None:
    assert scaled_lr(0.01, 64, 256, "linear") == pytest.approx(0.04)
    assert scaled_lr(0.01, 64, 256, "sqrt") == pytest.approx(0.02)
    assert scaled_lr(0.01, 64, 16, "none") == 0.01


def test_where_a_sweep_runs_is_not_what_it_is() -> None:
    """Resumed on another executor, scheduler or number of lanes, a sweep keeps its parent run and
    its earlier attempts' wall time (state.json's key), as its experiments keep their results;
    what it measures (a batch size, the epochs) makes it another sweep."""
    from batchlab.sweep.run import sweep_key

    base = sweep_key(tiny_config(), "data")
    moved = tiny_config(sweep={"executor": "dask", "dask_address": "tcp://10.0.0.2:8786", "parallel": 2})
    assert sweep_key(moved, "data") == base
    assert sweep_key(tiny_config(sweep={"epochs": 4}), "data") != base
    assert sweep_key(tiny_config(sweep={"batch_sizes": [16, 32]}), "data") != base


def test_sweeps_that_differ_have_parents_named_apart_and_say_their_configuration() -> None:
    from batchlab.sweep.run import configuration, sweep_name

    tags = {"batchlab.origin": "exp-quick-bf16", "batchlab.executor": "dask"}
    plain = tiny_config()
    names = {
        sweep_name(cfg, "dvc")
        for cfg in (plain, tiny_config(train={"precision": "bf16"}), tiny_config(train={"strategy": "ddp"}),
                    tiny_config(sweep={"seeds": [0, 1, 2]}))
    }  # fmt: skip
    assert len(names) == 4 and all(n.startswith("dvc-sweep-") for n in names)
    assert sweep_name(plain, "dvc") == sweep_name(plain, "dvc")  # the same settings: the same name
    bf16 = tiny_config(train={"precision": "bf16"})
    assert sweep_name(bf16, "exp-quick-bf16").startswith("exp-quick-bf16-sweep-single-bf16-bs16-64-")
    line = configuration(bf16, tags)
    assert line.startswith("Sweep of batch sizes 16, 32, 64 × 1 seed(s), 3 epochs: mlp on synthetic data, single bf16")
    assert line.endswith("; from exp-quick-bf16, trained dask.")


@pytest.mark.integration
def test_sweep_records_parent_children_and_report(workdir: Path) -> None:
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    cfg = tiny_config(tracking={**TRACK, "tracking_uri": uri}, sweep={"lr_scaling": "sqrt", "seeds": [0, 1]})
    stages.generate(cfg, Paths(workdir))
    summary = run_sweep(cfg, Paths(workdir))

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("sweep-test").experiment_id])
    parents = [r for r in runs if r.data.tags.get("sweep") == "parent"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(parents) == 1 and len(children) == 6 and len(runs) == 7
    parent = parents[0]
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parent.info.run_id}
    # what started it and what differs between sweeps: strategy, precision, batch range, a settings hash
    assert re.fullmatch(r"cli-sweep-single-fp32-bs16-64-[0-9a-f]{6}", parent.info.run_name), parent.info.run_name
    assert parent.data.tags["batchlab.origin"] == "cli" and parent.data.tags["batchlab.executor"] == "local"
    assert {c.data.tags["batchlab.origin"] for c in children} == {"cli"}
    assert sorted(c.info.run_name for c in children) == sorted(
        f"sweep-bs{b}-seed{s}" for b in (16, 32, 64) for s in (0, 1)
    )
    for child in children:
        batch = int(child.data.params["train.batch_size"])
        assert float(child.data.params["train.lr"]) == pytest.approx(0.01 * math.sqrt(batch / 32))
        assert child.data.params["train.epochs"] == "3"
        for key in ("test_f1_macro", "test_accuracy", "samples_per_s_table", "epoch_seconds_table",
                    "train_seconds", "step_memory_mib", "peak_rss_mib", "grad_norm_mean"):  # fmt: skip
            assert f"summary.{key}" in child.data.metrics, (batch, key)
        # per-epoch series hold epochs only: no summary figure logged at a stray step 0
        for key in ("val_loss", "samples_per_s", "gns.b_simple"):
            assert [m.step for m in client.get_metric_history(child.info.run_id, key)] == [1, 2, 3], key
    models = client.search_logged_models([runs[0].info.experiment_id])
    assert {m.source_run_id for m in models} == {c.info.run_id for c in children}

    folder = workdir / "reports/sweep"
    assert {p.name for p in folder.iterdir()} >= {
        "summary.csv", "summary.md", "experiments.csv", "curves.csv", "sweep.json", "steps_vs_examples.csv",
        "f1_vs_batch.png",
        "throughput_vs_batch.png", "memory_vs_batch.png", "steps_vs_examples.png", "val_loss_curves.png",
        "noise_scale_curves.png",
    }  # fmt: skip
    table = atomic.read_csv(folder / "summary.csv")
    assert [int(r["batch_size"]) for r in table] == [16, 32, 64]
    f1_16 = [c.data.metrics["summary.test_f1_macro"] for c in children if c.data.params["train.batch_size"] == "16"]
    assert float(table[0]["test_f1_macro_mean"]) == pytest.approx(sum(f1_16) / 2)
    memory = [float(r["step_memory_mib_mean"]) for r in table]
    assert memory == sorted(memory) and len(set(memory)) == 3  # the step's tensors grow with the batch
    text = (folder / "summary.md").read_text()
    assert "## Verdict" in text and f"Recommended: batch {summary['recommended_batch_size']}" in text
    assert "Test split: 90 rows" in text and "Target: val loss ≤" in text
    # three headline metrics (the runs table's columns); every figure as a rounded study.* tag
    assert set(parent.data.metrics) == {"recommended_batch_size", "best_f1_batch_size", "b_crit"}
    assert parent.data.metrics["recommended_batch_size"] == summary["recommended_batch_size"]
    written = json.loads((folder / "sweep.json").read_text())
    assert {k: v for k, v in written.items()} == {k: v for k, v in summary.items() if k != "markdown"}
    tags = parent.data.tags
    assert {f"study.{k}" for k in written} <= set(tags)
    assert float(tags["study.target_val_loss"]) == pytest.approx(summary["target_val_loss"], rel=5e-4)
    assert len(tags["study.target_val_loss"].replace(".", "").lstrip("0")) <= 4  # 4 significant digits
    # the description opens on the configuration, then the verdict (two lines), the view's link, the report
    note = tags["mlflow.note.content"]
    config, first, second, _, link, _ = note.split("\n", 5)
    assert config.startswith(
        "Sweep of batch sizes 16, 32, 64 × 2 seed(s), 3 epochs: mlp on synthetic data, single fp32"
    )
    assert config.endswith("from cli, trained local.")
    assert first.startswith(f"**Recommended: batch {summary['recommended_batch_size']}**, ") and second.startswith(
        "Beaten measurably in F1: "
    )
    assert f"(#/experiments/{parent.info.experiment_id}/runs?viewStateShareKey=batchlab-{parent.info.run_id}&" in link
    assert note.endswith(text)
    rows = {r["name"]: r for r in atomic.read_csv(folder / "steps_vs_examples.csv")}
    for child in children:  # the study's figures to its target, on each child: the compare page charts them
        mine = client.get_run(child.info.run_id).data.metrics
        point = rows[child.info.run_name.removeprefix("sweep-")]
        assert mine["summary.steps_to_target"] == float(point["steps"]) and "summary.seconds_to_target" in mine
    logged = client.load_table(parent.info.experiment_id, "sweep/summary_table.json", run_ids=[parent.info.run_id])
    assert sorted(logged["batch_size"]) == [16, 32, 64] and "steps_to_target_mean" in logged.columns


@pytest.mark.integration
def test_lr_multipliers_run_each_batch_size_at_each_lr_and_keep_the_best(workdir: Path) -> None:
    cfg = tiny_config(sweep={"batch_sizes": [16, 64], "lr_multipliers": [0.25, 1, 4]})
    stages.generate(cfg, Paths(workdir))
    summary = run_sweep(cfg, Paths(workdir))
    names = sorted(p.name for p in (workdir / "sweep/experiments").iterdir())
    assert names == sorted(f"bs{b}{m}-seed0" for b in (16, 64) for m in ("-lrx0.25", "", "-lrx4"))
    results = [json.loads(p.read_text()) for p in (workdir / "sweep/experiments").glob("*/result.json")]
    for batch in (16, 64):
        mine = [r for r in results if r["batch_size"] == batch]
        best = min(mine, key=lambda r: min(r["curve_val_loss"]))
        row = next(r for r in atomic.read_csv(workdir / "reports/sweep/summary.csv") if int(r["batch_size"]) == batch)
        assert float(row["lr_multiplier"]) == best["lr_multiplier"] and float(row["lr"]) == pytest.approx(best["lr"])
    assert "Learning rate kept per batch size" in summary["markdown"]


@pytest.mark.integration
def test_results_of_other_code_are_measured_again(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny_config(sweep={"batch_sizes": [16, 64]})
    stages.generate(cfg, Paths(workdir))
    run_sweep(cfg, Paths(workdir))
    local = executors.for_sweep(cfg)
    assert prepare(cfg, Paths(workdir), local).todo == []
    monkeypatch.setattr(sweep_plan, "code_hash", lambda: "edited")  # what an edit to src/batchlab does
    assert len(prepare(cfg, Paths(workdir), local).todo) == 2


def test_experiments_differ_only_in_batch_size_and_lr() -> None:
    cfg = tiny_config(train={"early_stopping_patience": 3}, sweep={"lr_scaling": "linear"})
    configs = [experiment_config(cfg, e) for e in plan(cfg, n_train=420)]
    first = configs[0].model_dump()
    for other in configs[1:]:
        dump = other.model_dump()
        changed = {k for k in first["train"] if first["train"][k] != dump["train"][k]}
        # the val split is scored ~10x per epoch, and the noise probe measures once an epoch
        assert changed <= {"batch_size", "lr", "eval_every_steps", "gns_every"}
        assert {s: dump[s] for s in dump if s != "train"} == {s: first[s] for s in first if s != "train"}
    assert {c.train.epochs for c in configs} == {3} and {c.train.early_stopping_patience for c in configs} == {0}
    assert [c.train.gns_every for c in configs] == [420 // c.train.batch_size for c in configs]
    weights = [initial_model(c, 8, 2).state_dict() for c in configs]
    assert all(torch.equal(weights[0][k], w[k]) for w in weights[1:] for k in w)


def test_the_fixed_rows_stay_fixed_when_params_ask_batchlab_train_for_an_adaptive_batch() -> None:
    """`dvc exp run -S train.adaptive_batch=true` (the README's) is for `batchlab train`: the sweep's
    fixed rows train at their batch size, and only sweep.adaptive's rows adapt (before, every fixed
    row adapted too, and under the time rule the sweep stopped asking for a step time)."""
    cfg = tiny_config(train={"adaptive_batch": True, "batch_size": 16}, sweep={"adaptive": True})
    configs = {e.name: experiment_config(cfg, e) for e in plan(cfg, n_train=420)}
    assert {name: c.train.adaptive_batch for name, c in configs.items()} == {
        name: name.startswith("adaptive") for name in configs
    }


def test_batch_larger_than_train_split_is_rejected_before_anything_runs(workdir: Path) -> None:
    cfg = tiny_config(sweep={"batch_sizes": [32, 4096]})
    stages.generate(cfg, Paths(workdir))
    with pytest.raises(ConfigError, match=r"sweep.batch_sizes \[4096\] are larger than the train split \(420 rows\)"):
        run_sweep(cfg, Paths(workdir))
    assert not (workdir / "sweep").exists() and not (workdir / "reports").exists()


def test_batch_not_dividing_across_ddp_ranks_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"sweep.batch_sizes \[15\] must divide by world size"):
        tiny_config(train={"strategy": "ddp", "nproc": 2}, sweep={"batch_sizes": [16, 15]})


@pytest.mark.integration
def test_killed_sweep_resumes_without_redoing_finished_experiments_and_counts_both_attempts(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    params = tiny_config(tracking={**TRACK, "tracking_uri": uri}, sweep={"epochs": 20}).model_dump()
    write_params(tmp_path, params)
    run(["batchlab", "generate"], tmp_path)
    proc = subprocess.Popen(["batchlab", "sweep"], cwd=tmp_path, env=env_with_venv(), stderr=subprocess.DEVNULL)
    first = tmp_path / "sweep/experiments/bs16-seed0/result.json"
    wait_until(first.exists, "the first experiment to finish", interval=0.1, process=proc)
    proc.kill()
    proc.wait()
    assert not (tmp_path / "reports/sweep/summary.md").exists()
    before = first.read_text()
    parent = json.loads((tmp_path / "sweep/state.json").read_text())["parent_run_id"]

    out = run(["batchlab", "sweep"], tmp_path)
    assert "resuming, 1 of 3 experiments already finished" in out.stderr
    assert first.read_text() == before
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("sweep-test").experiment_id])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent]
    finished = sorted(r.data.params["train.batch_size"] for r in children if r.info.status == "FINISHED")
    assert finished == ["16", "32", "64"]
    assert client.get_run(parent).info.status == "FINISHED"
    results = [json.loads(p.read_text()) for p in (tmp_path / "sweep/experiments").glob("*/result.json")]
    written = json.loads((tmp_path / "reports/sweep/sweep.json").read_text())
    assert written["sum_train_seconds"] == pytest.approx(sum(r["train_seconds"] for r in results))
    totals = client.get_run(parent).data.tags  # the resumed parent run holds both attempts' totals, rounded
    assert float(totals["study.sum_train_seconds"]) == pytest.approx(written["sum_train_seconds"], rel=5e-4)
    assert float(totals["study.sweep_wall_seconds"]) == pytest.approx(written["sweep_wall_seconds"], rel=5e-4)
    # one experiment at a time: the wall time of both attempts covers each experiment's own time
    assert written["sweep_wall_seconds"] >= sum(r["train_seconds"] + r["overhead_seconds"] for r in results)


@pytest.mark.integration
def test_parallel_sweep_runs_experiments_in_processes_without_tracking_collisions(workdir: Path) -> None:
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    sweep = {"parallel": 2, "batch_sizes": [16, 32], "seeds": [0, 1]}  # four experiments, two at a time
    cfg = tiny_config(tracking={**TRACK, "tracking_uri": uri}, sweep=sweep)
    stages.generate(cfg, Paths(workdir))
    run_sweep(cfg, Paths(workdir))
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("sweep-test").experiment_id])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(children) == 4 and all(r.info.status == "FINISHED" for r in children)
    table = atomic.read_csv(workdir / "reports/sweep/summary.csv")
    assert all(r["seeds"] == "2" for r in table)
    assert "±" in (workdir / "reports/sweep/summary.md").read_text()  # mean ± std across seeds


def _md5s(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _runs(uri: str) -> list[Any]:
    client = MlflowClient(uri)
    return client.search_runs([client.get_experiment_by_name("sweep-test").experiment_id])


@pytest.mark.integration
def test_rerun_of_a_finished_sweep_changes_nothing(
    workdir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    cfg = tiny_config(tracking={**TRACK, "tracking_uri": uri})
    paths = Paths(workdir)
    stages.generate(cfg, paths)
    run_sweep(cfg, paths)
    reports, state = workdir / "reports/sweep", workdir / "sweep/state.json"
    before, state_before, n_runs = _md5s(reports), state.read_bytes(), len(_runs(uri))
    exact = list(workdir.glob("sweep/experiments/*/reports/exact_noise.json"))  # the truth tasks'
    assert len(exact) == 3 and all(json.loads(p.read_text())["steps"] for p in exact)

    def measured(*args: object, **kwargs: object) -> None:
        raise AssertionError("a finished sweep measured again: its report reads what its tasks stored")

    # the sweep's measurements below it: the clock, the exact noise scale, an experiment's training
    monkeypatch.setattr(throughput, "measure", measured)
    monkeypatch.setattr(CurveWeights, "exact_at", measured)
    monkeypatch.setattr(experiment, "train_one", measured)

    caplog.set_level(logging.INFO, logger="batchlab")
    run_sweep(cfg, paths)
    assert "sweep: all 3 experiments already finished; nothing to do" in caplog.text
    assert "resuming" not in caplog.text
    assert _md5s(reports) == before and state.read_bytes() == state_before
    assert len(_runs(uri)) == n_runs

    # `dvc repro` deletes reports/sweep (cache: false) before the stage runs: the same bytes come back
    for file in reports.iterdir():
        file.unlink()
    run_sweep(cfg, paths)
    assert _md5s(reports) == before and len(_runs(uri)) == n_runs

    # the report only reads: with an experiment's truth gone, finish measures nothing and reads NaN
    exact[0].unlink()
    local = executors.for_sweep(cfg)
    with exclusive(paths):
        summary = finish(cfg, paths, prepare(cfg, paths, local), {}, tracking.Tracker(), origin_tags("local"))
    assert math.isfinite(summary["b_simple_exact_at_target"])  # the median over the other two
    assert _md5s(reports) != before  # the report says one reading fewer was checked


@pytest.mark.integration
def test_resumed_sweep_reports_totals_over_every_experiment(workdir: Path) -> None:
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    cfg = tiny_config(tracking={**TRACK, "tracking_uri": uri})
    paths = Paths(workdir)
    stages.generate(cfg, paths)
    first = run_sweep(cfg, paths)
    experiments = workdir / "sweep/experiments"
    kept = {name: (experiments / name / "result.json").read_text() for name in ("bs16-seed0", "bs64-seed0")}
    # bs32 as a killed attempt leaves it: no result.json, its run ended KILLED
    killed = json.loads((experiments / "bs32-seed0/result.json").read_text())["run_id"]
    (experiments / "bs32-seed0/result.json").unlink()
    MlflowClient(uri).set_terminated(killed, "KILLED")
    runs_before = {r.info.run_id for r in _runs(uri)}

    second = run_sweep(cfg, paths)
    new = [r for r in _runs(uri) if r.info.run_id not in runs_before]
    assert [r.info.run_name for r in new] == ["sweep-bs32-seed0"]  # only the missing experiment trained
    assert {name: (experiments / name / "result.json").read_text() for name in kept} == kept
    results = [json.loads(p.read_text()) for p in sorted(experiments.glob("*/result.json"))]
    assert len(results) == 3
    written = json.loads((workdir / "reports/sweep/sweep.json").read_text())
    assert written["sum_train_seconds"] == pytest.approx(sum(r["train_seconds"] for r in results))
    assert written["sum_train_seconds"] > max(r["train_seconds"] for r in results)
    # the wall time of the first attempt is kept, the resume's is added
    assert written["sweep_wall_seconds"] > first["sweep_wall_seconds"]
    assert written["sweep_wall_seconds"] >= sum(r["train_seconds"] + r["overhead_seconds"] for r in results)
    assert second["sweep_wall_seconds"] == written["sweep_wall_seconds"]


@pytest.mark.parametrize(
    ("parallel", "seeds"),
    [(1, [0, 1]), pytest.param(2, [0], marks=pytest.mark.integration)],  # seeds together; each in its own process
)
@pytest.mark.integration
def test_experiment_whose_run_finished_is_not_trained_again_without_its_result_json(
    workdir: Path, parallel: int, seeds: list[int]
) -> None:
    """Its process died after the child run ended FINISHED, before result.json was written (or it
    ran in another worker's folder): the resumed sweep takes the result the run stored."""
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    sweep_params = {"batch_sizes": [16, 32], "parallel": parallel, "seeds": seeds}
    cfg = tiny_config(tracking={**TRACK, "tracking_uri": uri}, sweep=sweep_params)
    paths = Paths(workdir)
    stages.generate(cfg, paths)
    first = run_sweep(cfg, paths)
    experiments = workdir / "sweep/experiments"
    names = [f"bs{b}-seed{s}" for b in (16, 32) for s in seeds]
    stored = {name: json.loads((experiments / name / "result.json").read_text()) for name in names}
    for name in stored:
        (experiments / name / "result.json").unlink()
    (workdir / "reports").joinpath("sweep", "sweep.json").unlink()
    runs_before = sorted((r.info.run_name, r.info.status) for r in _runs(uri))

    second = run_sweep(cfg, paths)
    assert sorted((r.info.run_name, r.info.status) for r in _runs(uri)) == runs_before  # no run trained again
    assert [n for n, status in runs_before if n.startswith("sweep-bs")] == sorted(f"sweep-{n}" for n in names)
    for name, result in stored.items():
        assert json.loads((experiments / name / "result.json").read_text()) == result
    assert second["best_f1_batch_size"] == first["best_f1_batch_size"]
    assert second["sum_train_seconds"] == first["sum_train_seconds"]


@pytest.mark.integration
def test_second_sweep_in_the_same_folder_refuses_at_once(repo_copy: Path, tmp_path: Path) -> None:
    """The first sweep is frozen (SIGSTOP) once it has planned, so it certainly still holds the lock
    when the second starts, whatever the load; then it goes on (SIGCONT) and finishes its 3 epochs."""
    uri = f"sqlite:///{repo_copy / 'mlflow.db'}"
    params = yaml.safe_load((repo_copy / "params.yaml").read_text())
    write_params(repo_copy, merge(params, {"tracking": {**TRACK, "tracking_uri": uri}}))
    run(["batchlab", "generate"], repo_copy)
    with (tmp_path / "first.err").open("w") as err:
        first = subprocess.Popen(
            ["batchlab", "sweep"], cwd=repo_copy, env=env_with_venv(), stderr=err, start_new_session=True
        )
    try:
        wait_until(  # the first sweep has planned and opened its parent run
            (repo_copy / "sweep/state.json").exists,
            "the first sweep's state",
            process=first,
            log=tmp_path / "first.err",
        )
        os.killpg(first.pid, signal.SIGSTOP)
        second = run(["batchlab", "sweep"], repo_copy, check=False)
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    assert first.wait(timeout=600) == 0, (tmp_path / "first.err").read_text()[-3000:]
    assert second.returncode == 1, (second.returncode, second.stderr[-3000:])
    assert second.stderr.splitlines() == [
        f"batchlab: error: another sweep is running in this folder (pid {first.pid}, lock .batchlab/sweep.lock); "
        "wait for it or stop it"
    ]
    assert second.stdout == ""

    runs = _runs(uri)
    parents = [r for r in runs if r.data.tags.get("sweep") == "parent"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(parents) == 1 and len(children) == 3 and len(runs) == 4
    assert all(r.info.status == "FINISHED" for r in runs)
    assert len(list((repo_copy / "sweep/experiments").glob("*/result.json"))) == 3
    assert [int(r["batch_size"]) for r in atomic.read_csv(repo_copy / "reports/sweep/summary.csv")] == [16, 32, 64]


@pytest.mark.integration
def test_dvc_rerun_of_a_finished_sweep_leaves_dvc_clean(repo_copy: Path) -> None:
    run(["dvc", "repro", "sweep"], repo_copy)
    lock, reports = (repo_copy / "dvc.lock").read_text(), _md5s(repo_copy / "reports/sweep")
    run(["batchlab", "sweep"], repo_copy)
    assert "up to date" in run(["dvc", "status", "sweep"], repo_copy).stdout
    out = run(["dvc", "repro", "-f", "sweep"], repo_copy)
    assert "all 3 experiments already finished; nothing to do" in out.stderr + out.stdout
    assert (repo_copy / "dvc.lock").read_text() == lock and _md5s(repo_copy / "reports/sweep") == reports

    shutil.rmtree(repo_copy / "sweep")  # what the README says re-measures
    out = run(["dvc", "repro", "sweep"], repo_copy)
    assert "Running stage 'sweep'" in out.stdout and "already finished" not in out.stderr + out.stdout
    assert len(list((repo_copy / "sweep/experiments").glob("*/result.json"))) == 3
    assert (repo_copy / "dvc.lock").read_text() != lock  # new measurements


def test_progress_counts_experiments_and_the_time_left_at_the_pace_so_far(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from batchlab.sweep import progress

    clock = iter([100.0, 130.0, 190.0, 190.0])  # started, after 1 experiment, after 3, at the end
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    caplog.set_level(logging.INFO, logger="batchlab.sweep.progress")
    with progress.counting(total=10, done=2) as counted:  # 2 finished in an earlier attempt
        assert counted.bar is None  # not a terminal (pytest's stderr): log lines
        progress.finished(["bs16-seed0"])
        progress.finished(["bs32-seed0", "bs32-seed1"])
    progress.finished(["outside"])  # no sweep counting: nothing
    assert [r.getMessage() for r in caplog.records] == [
        "sweep: 3/10 experiments done, about 3 min 30 s left",  # 30 s for 1: 7 left
        "sweep: 5/10 experiments done, about 2 min 30 s left",  # 90 s for 3: 5 left
    ]


@pytest.mark.integration
def test_on_a_terminal_the_sweep_draws_a_bar_of_experiments(workdir: Path) -> None:
    import fcntl
    import os
    import pty
    import struct
    import termios

    write_params(workdir, merge(TINY, {"sweep": {"batch_sizes": [16, 32], "seeds": [0]}}))
    run(["batchlab", "generate"], workdir)
    leader, follower = pty.openpty()  # stderr is a terminal, as in a user's shell: 120 columns wide
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(["batchlab", "sweep"], cwd=workdir, env=env_with_venv(), stdout=follower,
                            stderr=follower, stdin=subprocess.DEVNULL)  # fmt: skip
    os.close(follower)
    out = bytearray()
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the process closed the terminal: EIO
            break
        if not chunk:
            break
        out.extend(chunk)
    os.close(leader)
    text = out.decode(errors="replace")
    assert proc.wait(timeout=60) == 0, text
    assert "sweep: 100%" in text and "2/2" in text and "experiment" in text, text


@pytest.mark.e2e
def test_an_experiment_whose_end_the_server_missed_keeps_no_result_and_its_next_try_is_one_finished_run(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real `mlflow server` killed as an experiment's run ends: the experiment writes no
    result.json and fails as transient, naming what its run lacks (before: it counted as done, its
    child RUNNING without its end, and every rerun took its result.json for done). Its next try,
    with the server back, ends that run KILLED and records the experiment in one FINISHED run."""
    from batchlab import tracking
    from batchlab.sweep import scoring
    from batchlab.tracking import outage
    from tests.support import mlflow_on_postgres

    monkeypatch.setattr(outage, "FINAL_WAIT_S", 1.0)  # the end's wait for the server, 30 s by default
    with mlflow_on_postgres(workdir) as server:
        cfg = tiny_config(tracking={"enabled": True, "tracking_uri": server.uri, "experiment": "missed"})
        paths = Paths(workdir)
        stages.generate(cfg, paths)
        client = MlflowClient(server.uri)
        parent = client.create_run(client.create_experiment("missed")).info.run_id
        exp = plan(cfg, 420)[0]
        real = scoring.score

        def scored_then_the_server_dies(*args: Any, **kwargs: Any) -> dict[str, Any]:
            result = real(*args, **kwargs)
            server.kill()  # the run's end comes next
            return result

        monkeypatch.setattr(scoring, "score", scored_then_the_server_dies)
        with pytest.raises(tracking.TrackingUnavailable, match=r"lacks the end of the run \(FINISHED\)"):
            experiment.train_and_score(Lane(cfg, paths, parent), exp)
        assert not (folder_of(paths, exp).outputs / "result.json").exists()

        monkeypatch.setattr(scoring, "score", real)
        server.start()
        row = experiment.train_and_score(Lane(cfg, paths, parent), exp)
        runs = client.search_runs([client.get_experiment_by_name("missed").experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent}'")  # fmt: skip
        assert sorted(r.info.status for r in runs) == ["FINISHED", "KILLED"]
        (finished,) = [r for r in runs if r.info.status == "FINISHED"]
        assert finished.info.run_id == row["run_id"]
        (workdir / "got").mkdir()
        stored = client.download_artifacts(row["run_id"], scoring.RESULT_ARTIFACT, str(workdir / "got"))
        assert json.loads(Path(stored).read_text()) == json.loads(
            (folder_of(paths, exp).outputs / "result.json").read_text()
        )
