"""A Dask sweep whose servers die mid-sweep (#31 §2), each a real process killed while experiments
train: the MLflow server (PostgreSQL store), the Prefect server (its API) and the Dask scheduler.

Each time the sweep finishes, or stops with one line and a rerun finishes it; either way the
records come out as an uninterrupted sweep's: one FINISHED child run per experiment and no other,
every result.json whole and equal to the row its child run stored, the parent run's figures equal
to sweep.json, and the local executor's F1 per batch size."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlflow import MlflowClient

from batchlab.sweep.run import HEADLINE, study_tags
from tests.support import (
    copy_repo,
    merge,
    run,
    wait_until,
    write_params,
)
from tests.support.dask import Servers, assert_f1_equals_the_local_executor
from tests.support.dask import servers as dask_servers

SWEEP = {"batch_sizes": [16, 32], "seeds": [0], "executor": "dask", "epochs": 40}
OUTAGE_S = 5  # how long a killed server stays down before it is started again


def _workers(servers: Servers) -> None:
    """The scheduler and two workers up, started again where an earlier test killed them."""
    cluster = servers.cluster
    if "scheduler" not in cluster.procs or cluster.procs["scheduler"].poll() is not None:
        cluster.stop()
        cluster.scheduler()
    for name in ("w1", "w2"):
        if name not in cluster.procs or cluster.procs[name].poll() is not None:
            cluster.worker(name)
    cluster.warm()  # both experiments start at once: the faults land while both train


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    tmp = tmp_path_factory.mktemp("dask-faults")
    repo = copy_repo(tmp / "repo")
    run(["batchlab", "generate"], repo)
    with dask_servers(tmp, repo) as running:
        _workers(running)
        yield running


def _sweep_dir(servers: Servers, name: str) -> Path:
    folder = servers.repo.parent / name
    (folder / "data").mkdir(parents=True)
    shutil.copytree(servers.repo / "data" / "prepared", folder / "data" / "prepared")
    params = yaml.safe_load((servers.repo / "params.yaml").read_text())
    tracking = {"enabled": True, "experiment": name, "registered_model": ""}
    sweep = {**SWEEP, "dask_address": servers.cluster.address}
    write_params(folder, merge(params, {"tracking": tracking, "sweep": sweep}))
    return folder


def _start_sweep(folder: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(folder / "sweep.out", "w") as out, open(folder / "sweep.err", "w") as err:
        return subprocess.Popen(["batchlab", "sweep"], cwd=folder, env=env, stdout=out, stderr=err)


def _stderr(folder: Path) -> str:
    return (folder / "sweep.err").read_text(errors="replace")


def _training(folder: Path, proc: subprocess.Popen[bytes], n: int = 2) -> None:
    """Until `n` experiments train on the workers (their MLflow runs' sidecars are written)."""
    sidecars = lambda: len(list(folder.glob("sweep/experiments/*/.batchlab/checkpoints/train.pt.run"))) >= n  # noqa: E731
    wait_until(sidecars, f"{n} experiments to train", interval=0.1, process=proc, log=folder / "sweep.err")


def _same(a: Any, b: Any) -> bool:
    """Equal values, NaN equal to NaN (a figure the study could not compute)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _assert_records_as_uninterrupted(servers: Servers, folder: Path, tmp_path: Path) -> dict[str, str]:
    """One FINISHED child per experiment and no other child; each result.json whole and the row its
    child stored; the parent's figures those of sweep.json; the local executor's F1. The children's
    statuses, by run id."""
    client = MlflowClient(servers.mlflow.uri)
    parent_id = json.loads((folder / "sweep" / "state.json").read_text())["parent_run_id"]
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED"
    experiment = parent.info.experiment_id
    children = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent_id}'")
    finished = [c for c in children if c.info.status == "FINISHED"]
    assert sorted(c.info.run_name for c in finished) == ["sweep-bs16-seed0", "sweep-bs32-seed0"]
    # an attempt the fault cut short (its task retried) may be there, never a second FINISHED one
    assert {c.info.status for c in children} - {"FINISHED"} <= {"FAILED", "KILLED"}
    parents = [r for r in client.search_runs([experiment]) if "mlflow.parentRunId" not in r.data.tags]
    assert [r.info.run_id for r in parents] == [parent_id]  # no parent run of another attempt either
    rows = []
    for child in finished:
        name = child.info.run_name.removeprefix("sweep-")
        row = json.loads((folder / "sweep" / "experiments" / name / "result.json").read_text())
        stored = client.download_artifacts(child.info.run_id, "sweep/result.json", str(tmp_path))
        kept = json.loads(Path(stored).read_text())
        assert _same(kept, row), (kept, row)
        assert row["run_id"] == child.info.run_id
        rows.append(row)
    figures = json.loads((folder / "reports" / "sweep" / "sweep.json").read_text())
    assert figures["sum_train_seconds"] == pytest.approx(sum(r["train_seconds"] for r in rows), rel=1e-12)
    logged = {k: v for k, v in parent.data.tags.items() if k.startswith("study.")}
    assert logged == study_tags(figures), (logged, figures)
    shown = [k for k in HEADLINE if k in figures]  # b_crit: where the study could fit one
    assert {k: parent.data.metrics[k] for k in shown} == {k: float(figures[k]) for k in shown}
    assert_f1_equals_the_local_executor(folder, tmp_path)
    return {c.info.run_id: c.info.status for c in children}


@pytest.mark.e2e
@pytest.mark.parametrize("outage_s", [OUTAGE_S, 45], ids=["back-5-s-later", "back-45-s-later"])
def test_mlflow_server_killed_mid_sweep_and_back_later_the_sweep_finishes(
    outage_s: int, servers: Servers, tmp_path: Path
) -> None:
    """Back within a run's wait for it (BATCHLAB_TRACKING_WAIT_S, 30 s): its writes wait and go
    through. Back later: an experiment whose run ended in the outage is not done (its end, model
    and result row are missing from its child run), its task fails as transient and Prefect tries
    it again, which ends that run KILLED and records the experiment in a new FINISHED one. Before,
    the sweep exited 0 with such a child RUNNING without its model and result."""
    _workers(servers)
    folder = _sweep_dir(servers, f"mlflow-killed-{outage_s}")
    proc = _start_sweep(folder, servers.env)
    try:
        _training(folder, proc)
        servers.mlflow.kill()
        time.sleep(outage_s)
        servers.mlflow.start()
        assert proc.wait(timeout=600) == 0, _stderr(folder)[-5000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        if servers.mlflow.proc is None or servers.mlflow.proc.poll() is not None:
            servers.mlflow.start()  # for the tests after this one
    _assert_records_as_uninterrupted(servers, folder, tmp_path)


@pytest.mark.e2e
def test_prefect_server_killed_mid_sweep_and_back_5_s_later_the_sweep_finishes(
    servers: Servers, tmp_path: Path
) -> None:
    _workers(servers)
    folder = _sweep_dir(servers, "prefect-killed")
    proc = _start_sweep(folder, servers.env)
    try:
        _training(folder, proc)
        servers.prefect.kill()
        time.sleep(OUTAGE_S)
        servers.prefect.start()
        assert proc.wait(timeout=600) == 0, _stderr(folder)[-5000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    _assert_records_as_uninterrupted(servers, folder, tmp_path)


@pytest.mark.e2e
def test_prefect_server_killed_mid_sweep_for_good_is_one_line_and_the_rerun_finishes(
    servers: Servers, tmp_path: Path
) -> None:
    """Prefect's client retries a lost server for about a minute (5 retries, 2 to 32 s apart); two
    retries here (PREFECT_CLIENT_MAX_RETRIES=2), so that giving up comes after some 6 s."""
    _workers(servers)
    folder = _sweep_dir(servers, "prefect-gone")
    env = {**servers.env, "PREFECT_CLIENT_MAX_RETRIES": "2"}
    proc = _start_sweep(folder, env)
    try:
        _training(folder, proc)
        servers.prefect.kill()
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        servers.prefect.start()
    stderr = _stderr(folder)
    assert code == 1, stderr[-5000:]
    errors = [line for line in stderr.splitlines() if line.startswith("batchlab: error:")]
    assert errors == stderr.strip().splitlines()[-1:], stderr[-5000:]
    assert f"lost the Prefect server at {servers.prefect.api}" in errors[0], stderr[-5000:]
    rerun = _start_sweep(folder, servers.env)
    assert rerun.wait(timeout=600) == 0, _stderr(folder)[-5000:]
    _assert_records_as_uninterrupted(servers, folder, tmp_path)


@pytest.mark.e2e
def test_scheduler_killed_mid_sweep_is_one_line_and_the_rerun_finishes_with_one_run_each(
    servers: Servers, tmp_path: Path
) -> None:
    """A worker that loses its scheduler closes once its running experiment has finished (Dask
    waits for its executor): that experiment is stored, and the rerun, on a new scheduler, takes it."""
    _workers(servers)
    folder = _sweep_dir(servers, "scheduler-killed")
    proc = _start_sweep(folder, servers.env)
    try:
        _training(folder, proc)
        servers.cluster.kill("scheduler")
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = _stderr(folder)
    assert code == 1, stderr[-5000:]
    assert "lost the Dask scheduler at" in stderr.strip().splitlines()[-1], stderr[-5000:]
    workers = [servers.cluster.procs[name] for name in ("w1", "w2")]
    wait_until(lambda: all(w.poll() is not None for w in workers), "the workers to close", timeout=300)
    assert len(list(folder.glob("sweep/experiments/*/result.json"))) == 2  # both finished before they closed
    _workers(servers)  # a new scheduler: the sweep's address changes with it
    params = yaml.safe_load((folder / "params.yaml").read_text())
    write_params(folder, merge(params, {"sweep": {"dask_address": servers.cluster.address}}))
    rerun = _start_sweep(folder, servers.env)
    assert rerun.wait(timeout=600) == 0, _stderr(folder)[-5000:]
    assert "sweep: resuming, 2 of 2 experiments already finished" in _stderr(folder), _stderr(folder)[-5000:]
    _assert_records_as_uninterrupted(servers, folder, tmp_path)


def test_an_interrupt_lands_only_in_the_interrupted_sweeps_task_never_in_the_threads_next_one() -> None:
    """A Dask worker's thread runs one task after another. An interrupt that read a thread as the
    sweep's, then set the exception after the thread had moved on, raised it in whatever ran next
    (3 hits in 5 s of this loop, with threads switching every microsecond); set under the guard the
    thread leaves by, it lands in the sweep's task or nowhere. Each thread is told once: one told
    twice, its first exception landing in the context manager's exit before the thread left the
    register, took the second into its next task (1 in 3,000 under CI's load)."""
    import sys
    import threading

    from batchlab.sweep import stop
    from batchlab.tracking import Interrupted

    hits, done = {"task": 0, "next": 0}, threading.Event()

    def worker() -> None:
        while not done.is_set():
            try:
                try:
                    with stop.registered("interrupted-sweep"):
                        sum(range(20))  # the sweep's task
                except Interrupted:
                    hits["task"] += 1
                sum(range(20))  # the thread's next task, another sweep's
            except Interrupted:
                hits["next"] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        thread = threading.Thread(target=worker)
        thread.start()
        end = time.monotonic() + 5
        while time.monotonic() < end:
            stop.interrupt("interrupted-sweep")
        done.set()
        thread.join(10)
    finally:
        sys.setswitchinterval(interval)
    assert hits["next"] == 0 and hits["task"] > 0, hits
