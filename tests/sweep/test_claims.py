"""Two copies of one sweep task at once (Dask runs a task at least once: a frozen or partitioned
worker's task runs again elsewhere while the first copy still trains): each experiment is claimed
before it trains, the second copy waits, finds it committed and ends without recording."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from batchlab import stages
from batchlab.config import load_config
from batchlab.paths import Paths
from batchlab.sweep import lock
from tests.support import REPO, TINY, env_with_venv, merge, wait_until, write_params


def _start_copy(folder: Path, parent: str, names: list[str], tag: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "tests.support.task_copy", str(folder), parent, ",".join(names), f"{tag}.json"]
    with open(folder / f"{tag}.log", "w") as log:
        return subprocess.Popen(cmd, cwd=folder, env=env_with_venv(PYTHONPATH=str(REPO)), stdout=log, stderr=log)


def _log(folder: Path, tag: str) -> str:
    return (folder / f"{tag}.log").read_text(errors="replace")


@pytest.mark.integration
@pytest.mark.parametrize("seeds", [[0], [0, 1]], ids=["one-experiment", "seeds-trained-together"])
def test_two_copies_of_one_task_at_once_record_each_experiment_once(workdir: Path, seeds: list[int]) -> None:
    """Copy A claims and trains, and is frozen (SIGSTOP) mid-task; copy B starts, finds the claim
    held and waits; A is resumed and finishes; B then finds the rows committed and returns them
    without training or opening a run. Without the claim, B ended A's run KILLED and trained again."""
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    tracking = {"enabled": True, "tracking_uri": uri, "experiment": "copies", "registered_model": ""}
    sweep = {"batch_sizes": [16], "seeds": seeds, "epochs": 30}
    write_params(workdir, merge(TINY, {"tracking": tracking, "sweep": sweep}))
    cfg = load_config(workdir / "params.yaml")
    paths = Paths(workdir)
    stages.generate(cfg, paths)
    client = MlflowClient(uri)
    experiment = client.create_experiment("copies")
    parent = client.create_run(experiment).info.run_id
    names = [f"bs16-seed{s}" for s in seeds]
    claim = lock.claim_path(paths, names[0])

    first = _start_copy(workdir, parent, names, "a")
    second = None
    try:
        held = lambda: claim.is_file() and f"pid {first.pid} " in claim.read_text()  # noqa: E731
        wait_until(held, "copy A to claim its experiments", interval=0.02, process=first, log=workdir / "a.log")
        os.kill(first.pid, signal.SIGSTOP)  # frozen while it holds the claim
        second = _start_copy(workdir, parent, names, "b")
        waiting = lambda: "is claimed by another copy of its task" in _log(workdir, "b")  # noqa: E731
        wait_until(waiting, "copy B to wait for the claim", process=second, log=workdir / "b.log")
        assert second.poll() is None  # still waiting: it neither trained nor recorded
        os.kill(first.pid, signal.SIGCONT)
        assert first.wait(timeout=300) == 0, _log(workdir, "a")
        assert second.wait(timeout=300) == 0, _log(workdir, "b")
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()

    rows_a, rows_b = (json.loads((workdir / f"{t}.json").read_text()) for t in "ab")
    assert sorted(rows_a) == names and rows_b == rows_a  # B returned A's rows, byte for byte
    runs = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}'")
    assert sorted((r.info.run_name, r.info.status) for r in runs) == [(f"sweep-{n}", "FINISHED") for n in names]
    assert {rows_a[n]["run_id"] for n in names} == {r.info.run_id for r in runs}
    assert "train together" not in _log(workdir, "b") and "Epoch" not in _log(workdir, "b")


@pytest.mark.integration
def test_a_second_record_made_where_the_claim_did_not_reach_is_ended_killed_by_the_sweep(workdir: Path) -> None:
    """Workers with checkouts of their own share no claim: two may both record an experiment. The
    sweep keeps the run its result row names and ends the other KILLED, saying why; others stay."""
    from batchlab.sweep.plan import KEY_TAG
    from batchlab.tracking import children
    from batchlab.tracking.base import REAPED

    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    experiment = client.create_experiment("duplicates")
    parent = client.create_run(experiment).info.run_id

    def child(key: str | None) -> str:
        tags = {"mlflow.parentRunId": parent, **({KEY_TAG: key} if key else {})}
        run_id = client.create_run(experiment, tags=tags).info.run_id
        client.set_terminated(run_id, "FINISHED")
        return run_id

    kept, duplicate, other, untagged = child("k1"), child("k1"), child("k2"), child(None)
    assert children.end_duplicates(client, parent, KEY_TAG, {kept, other}) == [duplicate]
    status = {r: client.get_run(r).info.status for r in (kept, duplicate, other, untagged)}
    assert status == {kept: "FINISHED", duplicate: "KILLED", other: "FINISHED", untagged: "FINISHED"}
    assert client.get_run(duplicate).data.tags[REAPED].startswith("duplicate: sweep.key k1")
