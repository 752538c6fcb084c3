"""`batchlab reproduce RUN_ID`: a run made here rebuilds identically on CPU from its record; a run from a
dirty tree is refused; a record that disagrees with the rebuild gets a table of what differs."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import yaml
from mlflow import MlflowClient

from batchlab.tracking.provenance import git_tags
from tests.support import env_with_venv, run, set_params, wait_until

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_only_code_changes_make_a_tree_dirty_not_what_dvc_repro_rewrites(
    repo_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(repo_copy)
    assert git_tags()["git.dirty"] == "false"
    with (repo_copy / "dvc.lock").open("a") as lock:  # generate rewrote it before train started
        lock.write("\n")
    (repo_copy / "reports/metrics.json").write_text("{}\n")  # an output Git tracks (cache: false)
    with (repo_copy / "params.yaml").open("a") as params:  # `dvc exp run -S` edits it; the run records its params
        params.write("\n")
    assert git_tags()["git.dirty"] == "false"
    with (repo_copy / "src/batchlab/model/__init__.py").open("a") as code:
        code.write("# an edit not committed\n")
    assert git_tags()["git.dirty"] == "true"


def _store(repo: Path) -> str:
    return f"sqlite:///{repo / 'mlflow.db'}"


@pytest.mark.integration
def test_a_run_from_a_dirty_tree_or_without_a_commit_is_refused_in_one_line(repo_copy: Path) -> None:
    set_params(repo_copy, "tracking", enabled=True, tracking_uri=_store(repo_copy))
    client = MlflowClient(_store(repo_copy))
    experiment = client.create_experiment("batchlab")
    commit = run(["git", "rev-parse", "HEAD"], repo_copy).stdout.strip()
    dirty = client.create_run(experiment, tags={"git.commit": commit, "git.dirty": "true"}).info.run_id
    untracked = client.create_run(experiment).info.run_id
    for run_id, message in (
        (
            dirty,
            f"run {dirty} was made from a dirty tree (uncommitted changes at {commit[:12]}); no commit holds its code",
        ),
        (untracked, f"run {untracked} has no git.commit tag (made outside a git repo?)"),
    ):
        proc = run(["batchlab", "reproduce", run_id], repo_copy, check=False)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [f"batchlab: error: {message}"]


@pytest.mark.integration
def test_a_run_made_here_reproduces_identically_and_a_differing_record_gets_a_table(repo_copy: Path) -> None:
    set_params(repo_copy, "tracking", enabled=True, tracking_uri=_store(repo_copy))
    run(["git", "commit", "-qam", "track runs"], repo_copy)
    commit = run(["git", "rev-parse", "HEAD"], repo_copy).stdout.strip()
    run(["dvc", "repro", "evaluate"], repo_copy)  # generate rewrites dvc.lock: the run is still clean
    run_id = json.loads((repo_copy / "reports/train.json").read_text())["run_id"]
    tags = MlflowClient(_store(repo_copy)).get_run(run_id).data.tags
    assert (tags["git.commit"], tags["git.dirty"]) == (commit, "false") and tags["dvc.data_hash"].endswith(".dir")

    proc = run(["batchlab", "reproduce", run_id], repo_copy)
    [verdict] = proc.stdout.strip().splitlines()
    assert verdict.startswith(f"reproduce: run {run_id} at {commit[:12]}: identical ("), proc.stdout
    values = int(verdict.split("(")[1].split()[0])
    assert values >= 20  # data hash, test and last-epoch metrics, 2 weight tensors per layer
    assert len(run(["git", "worktree", "list"], repo_copy).stdout.splitlines()) == 1  # the temporary one is gone

    # the record says something else than the rebuild gives: a later value of a test metric
    client = MlflowClient(_store(repo_copy))
    recorded = client.get_run(run_id).data.metrics["test_accuracy"]
    client.log_metric(run_id, "test_accuracy", recorded - 0.25, step=1)
    proc = run(["batchlab", "reproduce", run_id], repo_copy, check=False)
    assert proc.returncode == 1
    assert proc.stdout.strip().splitlines() == [
        f"reproduce: run {run_id} at {commit[:12]}: 1 of {values} values differ",
        "| what | recorded | reproduced |",
        "|---|---|---|",
        f"| test_accuracy | {recorded - 0.25!r} | {recorded!r} |",
    ]
    assert (
        proc.stderr.strip().splitlines()[-1]
        == f"batchlab: error: run {run_id} did not reproduce (the table above says where)"
    )


@pytest.mark.integration
def test_a_dvc_exp_run_with_a_set_param_is_clean_and_reproduces(repo_copy: Path) -> None:
    """`dvc exp run -S` edits params.yaml in the workspace; the run records every param, so it is no
    reason to refuse: the rebuild at the commit, with the recorded params, gives the same weights."""
    set_params(repo_copy, "tracking", enabled=True, tracking_uri=_store(repo_copy))
    run(["git", "commit", "-qam", "track runs"], repo_copy)
    commit = run(["git", "rev-parse", "HEAD"], repo_copy).stdout.strip()
    run(["dvc", "exp", "run", "-S", "train.lr=0.004", "train"], repo_copy)
    assert "lr: 0.004" in (repo_copy / "params.yaml").read_text()  # uncommitted: the workspace holds the change
    run_id = json.loads((repo_copy / "reports/train.json").read_text())["run_id"]
    run_data = MlflowClient(_store(repo_copy)).get_run(run_id).data
    assert (run_data.params["train.lr"], run_data.tags["git.dirty"]) == ("0.004", "false")

    proc = run(["batchlab", "reproduce", run_id], repo_copy)
    assert proc.stdout.strip().startswith(f"reproduce: run {run_id} at {commit[:12]}: identical ("), proc.stdout


def _running_in(tree: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cwd"]):
        cwd = proc.info["cwd"]
        if cwd and Path(cwd).is_relative_to(tree):
            found.append(proc)
    return found


@pytest.mark.integration
def test_a_sigkilled_reproduce_leaves_a_worktree_and_processes_that_the_next_one_removes(repo_copy: Path) -> None:
    set_params(repo_copy, "tracking", enabled=True, tracking_uri=_store(repo_copy))
    run(["git", "commit", "-qam", "track runs"], repo_copy)
    run(["dvc", "repro", "evaluate"], repo_copy)
    run_id = json.loads((repo_copy / "reports/train.json").read_text())["run_id"]

    killed = subprocess.Popen(["batchlab", "reproduce", run_id], cwd=repo_copy, env=env_with_venv(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip

    def rebuilding() -> Path | None:
        listed = run(["git", "worktree", "list", "--porcelain"], repo_copy).stdout.splitlines()
        trees = [Path(line.split(" ", 1)[1]) for line in listed if line.startswith("worktree ")][1:]
        training = trees and any("train" in p.cmdline() for p in _running_in(trees[0]))
        return trees[0] if training else None

    tree = wait_until(rebuilding, "`dvc repro ... train` running in reproduce's worktree", process=killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=30)
    assert tree.is_dir() and _running_in(tree)  # what SIGKILL leaves: the worktree, and dvc still running in it

    proc = run(["batchlab", "reproduce", run_id], repo_copy)
    assert f"reproduce: removed {tree}, left by an interrupted reproduce" in proc.stderr, proc.stderr
    assert ": identical (" in proc.stdout, proc.stdout
    assert not tree.exists() and not _running_in(tree)
    assert len(run(["git", "worktree", "list"], repo_copy).stdout.splitlines()) == 1


def test_recorded_params_load_back_as_the_config_read_them_exponent_floats_included() -> None:
    """MLflow holds str(value): the time rule's step time [a, b, p] has floats Python writes as 5e-07,
    which YAML reads as a string; every recorded param must load back to what the run trained with."""
    from batchlab.audit.reproduce import rebuild_params
    from batchlab.config import load_config, parse_config
    from batchlab.tracking.record import RunRecord

    base = load_config(REPO / "params.yaml")
    raw = base.model_dump()
    raw["train"].update(adaptive_batch=True, adapt_step_time=[0.0002, 5e-07, 0.0165])
    cfg = parse_config(raw)
    record = RunRecord("r", {}, {k: str(v) for k, v in cfg.flat().items()}, {}, "0")
    rebuilt = parse_config(yaml.safe_load(rebuild_params(record, (REPO / "params.yaml").read_text())))
    assert rebuilt.train.adapt_step_time == [0.0002, 5e-07, 0.0165] and rebuilt.model == cfg.model
