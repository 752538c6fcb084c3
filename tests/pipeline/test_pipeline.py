"""End to end through the real CLI and a real DVC repo (a temporary copy of this one)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from tests.support import default_sigint, env_with_venv, run, set_params, wait_until

pytestmark = pytest.mark.integration


def _ran(output: str) -> set[str]:
    return {s for s in ("validate", "generate", "train", "evaluate", "export") if f"Running stage '{s}'" in output}


def test_dvc_repro_builds_everything_then_only_what_changed(repo_copy: Path) -> None:
    first = run(["dvc", "repro"], repo_copy)
    assert _ran(first.stdout) == {"validate", "generate", "train", "evaluate", "export"}
    metrics = json.loads((repo_copy / "reports/metrics.json").read_text())
    assert metrics["f1_macro"] > 0.8 and metrics["accuracy"] > 0.8
    report = json.loads((repo_copy / "reports/export.json").read_text())
    assert report["max_abs_diff"] <= 1e-4 and [p["batch"] for p in report["parity"]][:2] == [1, 7]
    assert (repo_copy / "models/model.onnx").stat().st_size == report["file_bytes"]
    summary = json.loads((repo_copy / "data/prepared/dataset.json").read_text())
    assert summary["splits"]["train"]["rows"] == 420 and len(summary["content_hash"]) == 16

    again = run(["dvc", "repro"], repo_copy)
    assert _ran(again.stdout) == set(), again.stdout

    set_params(repo_copy, "train", lr=0.02)
    changed = run(["dvc", "repro"], repo_copy)
    assert _ran(changed.stdout) == {"validate", "train", "evaluate", "export"}

    shown = run(["dvc", "metrics", "show"], repo_copy).stdout
    for key in ("precision_macro", "recall_macro", "f1_macro", "accuracy"):
        assert key in shown
    run(["dvc", "plots", "show", "-o", "plots_html"], repo_copy)
    html = (repo_copy / "plots_html/index.html").read_text()
    assert "Loss curves" in html and "Confusion matrix (test)" in html


def test_dvc_exp_run_with_override_is_compared_by_exp_show(repo_copy: Path) -> None:
    run(["dvc", "repro"], repo_copy)
    run(["git", "add", "-A"], repo_copy)
    run(["git", "commit", "-qm", "baseline"], repo_copy)
    run(["dvc", "exp", "run", "-S", "train.batch_size=64", "-n", "bs64"], repo_copy)
    rows = json.loads(run(["dvc", "exp", "show", "--json"], repo_copy).stdout)
    exps = [e for row in rows for e in (row.get("experiments") or [])]
    names = [e.get("name") for e in exps]
    assert "bs64" in names, rows
    bs64 = next(e for e in exps if e.get("name") == "bs64")["revs"][0]["data"]
    assert bs64["params"]["params.yaml"]["data"]["train"]["batch_size"] == 64
    assert "f1_macro" in bs64["metrics"]["reports/metrics.json"]["data"]


def test_bad_params_exit_2_with_one_line_and_leave_outputs_untouched(repo_copy: Path) -> None:
    run(["batchlab", "generate"], repo_copy)
    before = (repo_copy / "data/prepared/x_train.npy").read_bytes()
    set_params(repo_copy, "train", batch_size=-3)
    proc = run(["batchlab", "train"], repo_copy, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "batchlab: error: train.batch_size: Input should be greater than 0, got -3"
    set_params(repo_copy, "train", batch_size=4096)
    proc = run(["batchlab", "train"], repo_copy, check=False)
    assert proc.returncode == 2 and "larger than the train split (420 rows)" in proc.stderr
    set_params(repo_copy, "data", source="csv", csv_path="missing.csv")
    proc = run(["batchlab", "generate"], repo_copy, check=False)
    assert proc.returncode == 2 and "data.csv_path 'missing.csv' does not exist" in proc.stderr
    assert (repo_copy / "data/prepared/x_train.npy").read_bytes() == before
    assert not (repo_copy / "models/model.pt").exists()


def test_killed_train_resumes_from_checkpoint_and_matches_uninterrupted(repo_copy: Path) -> None:
    set_params(repo_copy, "train", epochs=40, batch_size=16)
    set_params(repo_copy, "model", dropout=0.2)
    run(["batchlab", "generate"], repo_copy)
    run(["batchlab", "train"], repo_copy)
    expected = torch.load(repo_copy / "models/model.pt", weights_only=True)["state_dict"]
    (repo_copy / "models/model.pt").unlink()

    checkpoint = repo_copy / ".batchlab/checkpoints/train.pt"
    proc = subprocess.Popen(["batchlab", "train"], cwd=repo_copy, env=env_with_venv(), stderr=subprocess.PIPE)
    wait_until(
        lambda: torch.load(checkpoint, weights_only=True)["state"]["epoch"] >= 3,
        "a checkpoint of epoch 3",
        interval=0.05,
        process=proc,  # fails if training finished before it could be interrupted
    )
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (repo_copy / "models/model.pt").exists()

    resumed = run(["batchlab", "train"], repo_copy)
    assert "resuming from" in resumed.stderr
    got = torch.load(repo_copy / "models/model.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert not checkpoint.exists()  # removed once training completed


def _md5s(repo: Path, *files: str) -> dict[str, str]:
    return {f: hashlib.md5((repo / f).read_bytes()).hexdigest() for f in files}


def _changes(repo: Path, *targets: str) -> set[str]:
    """What `dvc status` says changed, as 'stage: path' ('train: params.yaml', 'train: models/model.pt')."""
    status = json.loads(run(["dvc", "status", "--json", *targets], repo).stdout)
    changed = set()
    for stage, entries in status.items():
        for entry in entries:  # {"changed deps": {path: state}}, {"changed outs": ...} or "changed command"
            paths = [entry] if isinstance(entry, str) else [p for change in entry.values() for p in change]
            changed |= {f"{stage}: {path}" for path in paths}
    return changed


TRAIN_OUTPUTS = ("models/model.pt", "reports/history.csv", "reports/train.json", "reports/train_summary.json")


def test_bad_params_under_dvc_repro_stop_before_any_output_is_removed(repo_copy: Path) -> None:
    run(["dvc", "repro"], repo_copy)
    outputs = (*TRAIN_OUTPUTS, "reports/metrics.json", "reports/sweep/summary.csv", "reports/sweep/sweep.json")
    before = _md5s(repo_copy, *outputs)

    set_params(repo_copy, "train", lr=-0.01)
    proc = run(["dvc", "repro"], repo_copy, check=False)
    assert proc.returncode != 0
    assert "batchlab: error: train.lr: Input should be greater than 0, got -0.01" in proc.stderr + proc.stdout
    assert _md5s(repo_copy, *outputs) == before
    assert _changes(repo_copy) == {"validate: params.yaml", "train: params.yaml", "sweep: params.yaml"}

    set_params(repo_copy, "train", lr=0.01)
    set_params(repo_copy, "sweep", batch_sizes=[16, 4096])
    proc = run(["dvc", "repro"], repo_copy, check=False)
    assert proc.returncode != 0 and "sweep.batch_sizes [4096] are larger than the train split (420 rows)" in (
        proc.stderr + proc.stdout
    )
    assert _md5s(repo_copy, *outputs) == before
    assert _changes(repo_copy) == {"validate: params.yaml", "sweep: params.yaml"}


def test_run_cache_restores_train_when_params_come_back(repo_copy: Path) -> None:
    run(["dvc", "repro", "train"], repo_copy)
    first = _md5s(repo_copy, *TRAIN_OUTPUTS)
    set_params(repo_copy, "train", lr=0.02)
    assert "train" in _ran(run(["dvc", "repro", "train"], repo_copy).stdout)
    set_params(repo_copy, "train", lr=0.01)  # TINY's value: the first run's
    again = run(["dvc", "repro", "train"], repo_copy)
    assert "Stage 'train' is cached - skipping run" in again.stdout, again.stdout
    assert _md5s(repo_copy, *TRAIN_OUTPUTS) == first


def test_editing_the_csv_source_reruns_generate(repo_copy: Path) -> None:
    rows = ["a,b,target"] + [f"{i % 7},{(i * 3) % 11},{i % 2}" for i in range(120)]
    csv = repo_copy / "data/raw/table.csv"
    csv.write_text("\n".join(rows) + "\n")
    set_params(repo_copy, "data", source="csv", csv_path="data/raw/table.csv")
    set_params(repo_copy, "sweep", batch_sizes=[16])
    run(["dvc", "repro", "generate"], repo_copy)
    hash_before = json.loads((repo_copy / "data/prepared/dataset.json").read_text())["content_hash"]
    assert not {c for c in _changes(repo_copy) if c.startswith(("validate", "generate"))}

    csv.write_text("\n".join([*rows[:-1], "6,10,0"]) + "\n")  # one value edited
    assert "generate: data/raw" in _changes(repo_copy)
    assert "generate" in _ran(run(["dvc", "repro", "generate"], repo_copy).stdout)
    assert json.loads((repo_copy / "data/prepared/dataset.json").read_text())["content_hash"] != hash_before

    outside = repo_copy / "table.csv"
    outside.write_text(csv.read_text())
    set_params(repo_copy, "data", csv_path="table.csv")
    proc = run(["batchlab", "validate"], repo_copy, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "batchlab: error: data.csv_path must be a file under data/raw/ (generate's DVC dependency), "
        "got 'table.csv'; move it there, e.g. data/raw/table.csv"
    )


def test_ctrl_c_exits_130_keeps_the_checkpoint_and_ends_the_run_killed(repo_copy: Path) -> None:
    set_params(repo_copy, "train", epochs=400, batch_size=16)
    set_params(repo_copy, "tracking", enabled=True)
    run(["batchlab", "generate"], repo_copy)
    checkpoint = repo_copy / ".batchlab/checkpoints/train.pt"
    proc = subprocess.Popen(
        ["batchlab", "train"], cwd=repo_copy, env=env_with_venv(), stderr=subprocess.PIPE, preexec_fn=default_sigint
    )
    wait_until(lambda: torch.load(checkpoint, weights_only=True)["state"]["epoch"] >= 2, "epoch 2", process=proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.decode().strip().endswith("batchlab: interrupted")
    assert checkpoint.exists() and not (repo_copy / "models/model.pt").exists()
    client = MlflowClient(f"sqlite:///{repo_copy / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("batchlab").experiment_id])
    assert [r.info.status for r in runs] == ["KILLED"]
    name = runs[0].info.run_name  # what made it, then what it trained
    assert name.startswith("cli-train-bs16-lr") and name.endswith("-single-fp32"), name


def test_a_second_dvc_repro_at_once_is_refused_and_the_first_completes(repo_copy: Path) -> None:
    first = subprocess.Popen(
        ["dvc", "repro", "train"], cwd=repo_copy, env=env_with_venv(), stdout=subprocess.PIPE, start_new_session=True
    )
    # validate's stamp: the first repro is past its first stage, holding DVC's repo lock until train
    # ends; frozen (SIGSTOP) while the second runs, so it certainly still holds it, whatever the load
    wait_until(lambda: (repo_copy / ".batchlab/params.ok").exists(), "the first repro's validate", process=first)
    os.killpg(first.pid, signal.SIGSTOP)
    try:
        second = run(["dvc", "repro", "train"], repo_copy, check=False)
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    # DVC's lock on the stage's outputs (rwlock) or on the repo, or, under load, SQLite's on DVC's
    # state database held by the frozen first ("unexpected error - locking protocol", seen once at
    # load 4 on 2 cores; "unexpected error - database is locked", once at load 3): each way the
    # second touches nothing, which the lines below check
    refused = second.stderr + second.stdout
    said = ("is busy", "Unable to acquire lock", "locking protocol", "database is locked")
    assert second.returncode != 0 and any(s in refused for s in said), refused
    out, _ = first.communicate(timeout=600)
    assert first.returncode == 0 and "train" in _ran(out.decode())
    assert _changes(repo_copy, "train") == set()
