"""A team shares data, stage results and experiments through a DVC directory remote and a Git
remote (a bare repo): what one clone ran, another restores instead of running it again."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support import copy_repo, run

pytestmark = pytest.mark.integration


def _ran(repro: subprocess.CompletedProcess[str]) -> list[str]:
    """The stages `dvc repro` ran (not those it restored from the run-cache)."""
    out = repro.stdout + repro.stderr
    return [line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage '")]


def _restored(repro: subprocess.CompletedProcess[str]) -> list[str]:
    out = repro.stdout + repro.stderr
    return [line.split("'")[1] for line in out.splitlines() if "is cached - skipping run" in line]


def _team(tmp_path: Path) -> tuple[Path, Path]:
    """Alice's repo with a directory DVC remote and a bare Git remote; Bob's clone of it."""
    alice = copy_repo(tmp_path / "alice")
    run(["git", "init", "-q", "--bare", str(tmp_path / "origin.git")], tmp_path)
    run(["git", "remote", "add", "origin", str(tmp_path / "origin.git")], alice)
    run(["dvc", "remote", "add", "-d", "team", str(tmp_path / "dvc-remote")], alice)
    # the pipeline up to train keeps this quick; no stage results yet (the copied dvc.lock describes
    # the real params' outputs, cached nowhere here)
    pipeline = yaml.safe_load((alice / "dvc.yaml").read_text())
    pipeline["stages"] = {k: v for k, v in pipeline["stages"].items() if k in ("validate", "generate", "train")}
    (alice / "dvc.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    run(["git", "rm", "-q", "dvc.lock"], alice)
    run(["git", "commit", "-qam", "a DVC remote for the team"], alice)
    run(["git", "push", "-q", "origin", "HEAD:main"], alice)
    bob = tmp_path / "bob"
    run(["git", "clone", "-q", "-b", "main", str(tmp_path / "origin.git"), str(bob)], tmp_path)
    return alice, bob


def test_pushed_run_cache_restores_stages_in_a_second_clone_and_committed_results_run_nothing(tmp_path: Path) -> None:
    alice, bob = _team(tmp_path)
    first = run(["dvc", "repro"], alice)
    assert _ran(first) == ["validate", "generate", "train"]
    # Alice shares her stage results without committing dvc.lock
    run(["dvc", "push", "--run-cache"], alice)

    run(["dvc", "fetch", "--run-cache"], bob)  # no dvc.lock yet: nothing to check out
    again = run(["dvc", "repro", "--pull"], bob)
    # DVC restores a stage from the run-cache only when its uncached outputs already match: generate's
    # outputs are all cached; train's metrics and plots (cache: false) live in Git, and validate's
    # stamp is persistent, so those two run again until Alice commits them (below)
    assert _restored(again) == ["generate"] and _ran(again) == ["validate", "train"]
    prepared = "data/prepared/dataset.json"
    assert (bob / prepared).read_bytes() == (alice / prepared).read_bytes()

    # once Alice commits the results, Bob's pull + repro runs nothing at all
    run(["git", "add", "-A"], alice)
    run(["git", "commit", "-qm", "trained"], alice)
    run(["dvc", "push"], alice)
    run(["git", "push", "-q", "origin", "HEAD:main"], alice)
    # Bob drops his own rerun for Alice's committed one
    (bob / "dvc.lock").unlink()
    run(["git", "checkout", "-q", "--", "."], bob)
    run(["git", "pull", "-q", "origin", "main"], bob)
    run(["dvc", "pull"], bob)
    none = run(["dvc", "repro"], bob)
    assert _ran(none) == [] and _restored(none) == [], none.stdout


def test_an_experiment_pushed_from_one_clone_is_pulled_and_applied_in_another(tmp_path: Path) -> None:
    alice, bob = _team(tmp_path)
    run(["dvc", "repro"], alice)
    run(["git", "add", "-A"], alice)
    run(["git", "commit", "-qm", "baseline"], alice)
    run(["dvc", "push"], alice)
    run(["git", "push", "-q", "origin", "HEAD:main"], alice)
    run(["dvc", "exp", "run", "-n", "lr-002", "-S", "train.lr=0.02"], alice)
    run(["dvc", "exp", "push", "origin", "lr-002"], alice)

    run(["git", "pull", "-q", "origin", "main"], bob)
    run(["dvc", "exp", "pull", "origin", "lr-002"], bob)
    assert "lr-002" in run(["dvc", "exp", "list", "--name-only"], bob).stdout
    run(["dvc", "exp", "apply", "lr-002"], bob)
    assert yaml.safe_load((bob / "params.yaml").read_text())["train"]["lr"] == 0.02
    run(["dvc", "checkout"], bob)  # the experiment's model, from the DVC remote: nothing retrained
    run(["dvc", "exp", "apply", "lr-002"], alice)
    assert (bob / "models/model.pt").read_bytes() == (alice / "models/model.pt").read_bytes()
    assert run(["dvc", "status"], bob).stdout.strip().endswith("up to date.")
