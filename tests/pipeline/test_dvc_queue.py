"""`dvc exp run --temp` and DVC's queue from a shell where the venv is not active. Both run the stages
in a copy of the repo under .dvc/tmp/exps/, which has no .venv: the stage commands find the project's
through DVC_ROOT (its root, for these runs too), and `dvc queue start` gets the venv on PATH because
DVC's queue workers run `dvc` by name (docs/tracking.md)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from mlflow import MlflowClient

from tests.support import BIN, env_with_venv, run, set_params, wait_until

pytestmark = pytest.mark.integration

QUEUE_START = 'PATH="$PWD/.venv/bin:$PATH" .venv/bin/dvc queue start -j 2'  # as docs/tracking.md shows it


def _plain_shell() -> dict[str, str]:
    """A user's shell: no venv on PATH (and no other dvc or batchlab there)."""
    env = env_with_venv()
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if Path(p) != BIN)
    env.pop("VIRTUAL_ENV", None)
    return env


def _sh(command: str, repo: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(["bash", "-c", command], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"`{command}` exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _start_queue(repo: Path, env: dict[str, str]) -> None:
    """`dvc queue start`, as the docs show it. It starts its workers in the background, and a worker
    can keep an inherited pipe open: its output goes to a file, not to a pipe waited on to its end."""
    log = repo / "queue-start.log"
    with log.open("w") as out:
        proc = subprocess.run(["bash", "-c", QUEUE_START], cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=120)  # fmt: skip
    assert proc.returncode == 0, log.read_text()[-3000:]


def _stop_queue(repo: Path, env: dict[str, str]) -> None:
    """`dvc queue stop`, then any worker of this repo still there: the test leaves no process behind."""
    subprocess.run(["bash", "-c", ".venv/bin/dvc queue stop"], cwd=repo, env=env, capture_output=True, timeout=120)
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "queue-worker" in cmdline and str(repo) in cmdline:
            with contextlib.suppress(psutil.Error):
                proc.kill()


def _queue_done(repo: Path, env: dict[str, str]) -> dict[str, str] | None:
    """Each queued experiment's status once none is queued or running (`dvc queue status`), else None."""
    table = _sh(".venv/bin/dvc queue status", repo, env).split("\n\n")[0]  # then "Worker status: …"
    statuses = {row.split()[1]: row.split()[-1] for row in table.splitlines()[1:]}  # Task Name Created Status
    if any(status in ("Queued", "Running") for status in statuses.values()):
        return None
    return statuses


def _lrs(repo: Path, env: dict[str, str]) -> dict[str, tuple[float, Any]]:
    """Each experiment's name -> its train.lr and its train summary, from `dvc exp show --json`."""
    rows = json.loads(_sh(".venv/bin/dvc exp show --json", repo, env))
    found = {}
    for exp in (e for row in rows for e in (row.get("experiments") or [])):
        data = exp["revs"][0]["data"]
        summary = (data.get("metrics") or {}).get("reports/train_summary.json", {}).get("data")
        found[exp["name"]] = (data["params"]["params.yaml"]["data"]["train"]["lr"], summary)
    return found


def test_temp_and_queued_experiments_run_without_the_venv_on_path(repo_copy: Path) -> None:
    (repo_copy / ".venv").symlink_to(sys.prefix)  # what `make run` creates
    # tracked with the default relative store: the runs must land in the project's, not in DVC's copies
    set_params(repo_copy, "tracking", enabled=True, tracking_uri="sqlite:///mlflow.db")
    run(["git", "commit", "-qam", "track"], repo_copy)
    env = _plain_shell()
    assert subprocess.run(["bash", "-c", "command -v batchlab dvc"], env=env).returncode != 0

    _sh(".venv/bin/dvc exp run --temp -n temp-lr -S train.lr=0.004 train", repo_copy, env)
    client = MlflowClient(f"sqlite:///{repo_copy / 'mlflow.db'}")
    [tracked] = client.search_runs([client.get_experiment_by_name("batchlab").experiment_id])
    assert tracked.data.params["train.lr"] == "0.004" and tracked.info.status == "FINISHED"
    assert str(repo_copy / "mlruns") in tracked.info.artifact_uri, tracked.info.artifact_uri  # not in DVC's copy
    assert "history.csv" in {a.path for a in client.list_artifacts(tracked.info.run_id)}

    set_params(repo_copy, "tracking", enabled=False)  # the queue's experiments: DVC's part alone
    run(["git", "commit", "-qam", "untracked"], repo_copy)
    _sh(".venv/bin/dvc exp run --queue -S 'train.lr=0.002,0.008' train", repo_copy, env)  # a grid: two queued
    started = time.monotonic()
    try:
        _start_queue(repo_copy, env)
        statuses = wait_until(lambda: _queue_done(repo_copy, env), "the queue to run both experiments", interval=2)
    finally:
        _stop_queue(repo_copy, env)  # workers idle out by themselves; stop them now
    print(f"queue of 2 with -j 2: {time.monotonic() - started:.1f} s")
    assert sorted(statuses.values()) == ["Success", "Success"], statuses

    runs = _lrs(repo_copy, env)
    assert sorted(lr for lr, _ in runs.values()) == [0.002, 0.008], runs  # the queue's, on this commit
    assert all(summary for _, summary in runs.values()), runs  # each trained and recorded its metrics
