"""The sweep on a real Dask cluster through Prefect: `dask scheduler` + 2 `dask worker` processes,
a `prefect server` and an `mlflow server` on PostgreSQL, all on 127.0.0.1.

Worker w1 shares the sweep's folder (a shared path); worker w2 has its own clone of the repo
without data, so it fetches the data with `dvc pull` from a directory remote."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from mlflow import MlflowClient

from batchlab import stages
from batchlab.config import load_config, parse_config
from batchlab.paths import Paths
from batchlab.sweep.run import run_sweep
from tests.support import (
    REPO,
    TINY,
    MlflowServer,
    copy_repo,
    env_with_venv,
    free_port,
    merge,
    mlflow_on_postgres,
    prefect_server,
    run,
    wait_until,
    write_params,
)
from tests.support.dask import Cluster, assert_f1_equals_the_local_executor

SWEEP = {"batch_sizes": [16, 32], "seeds": [0], "executor": "dask"}
TRACK = {"enabled": True, "experiment": "dask-sweep", "registered_model": ""}


@dataclass
class Setup:
    repo: Path  # the sweep's repo: prepared data, pushed to the DVC remote
    clone: Path  # worker w2's checkout: no data until it pulls
    cluster: Cluster
    mlflow: MlflowServer
    env: dict[str, str]  # what `batchlab sweep` runs with: the Prefect and MLflow servers


def _w2(setup: Setup) -> None:
    """Worker w2 running in its clone, started again when an earlier test killed it."""
    if setup.cluster.procs["w2"].poll() is not None:
        setup.cluster.worker("w2", BATCHLAB_WORKER_ROOT=str(setup.clone))


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One `prefect server` for the module's sweeps: its API URL."""
    with prefect_server(tmp_path_factory.mktemp("prefect")) as url:
        yield url


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, api: str) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("dask")
    repo = copy_repo(tmp / "repo")
    with mlflow_on_postgres(tmp) as mlflow:
        params = yaml.safe_load((repo / "params.yaml").read_text())
        write_params(repo, merge(params, {"tracking": TRACK}))
        run(["git", "commit", "-qam", "tracked"], repo)
        run(["dvc", "repro", "-q", "generate"], repo)
        run(["dvc", "remote", "add", "-d", "shared", str(tmp / "dvc-remote")], repo)
        run(["dvc", "push", "-q", "generate"], repo)
        run(["git", "add", "-A"], repo)
        run(["git", "commit", "-qm", "data in the remote"], repo)
        clone = tmp / "clone"
        run(["git", "clone", "-q", str(repo), str(clone)], tmp)
        env = env_with_venv(PREFECT_API_URL=api, MLFLOW_TRACKING_URI=mlflow.uri)
        cluster = Cluster(tmp, env)
        try:
            # at most one task a one-thread worker (Dask's default, 1.1, queues a second on it): two
            # experiments on two idle workers go one to each, so pausing w1 leaves w2 one to finish
            cluster.scheduler(DASK_DISTRIBUTED__SCHEDULER__WORKER_SATURATION="1.0")
            cluster.worker("w1")
            cluster.worker("w2", BATCHLAB_WORKER_ROOT=str(clone))
            yield Setup(repo, clone, cluster, mlflow, env)
        finally:
            cluster.stop()


def _sweep_dir(setup: Setup, name: str, **sweep_params: Any) -> Path:
    """A folder with the repo's params and prepared data, its sweep on the test cluster."""
    folder = setup.repo.parent / name
    (folder / "data").mkdir(parents=True)
    shutil.copytree(setup.repo / "data" / "prepared", folder / "data" / "prepared")
    params = yaml.safe_load((setup.repo / "params.yaml").read_text())
    write_params(folder, merge(params, {"sweep": {**SWEEP, "dask_address": setup.cluster.address, **sweep_params}}))
    return folder


def _sweep(folder: Path, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["batchlab", "sweep"], cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-5000:]
    return proc


def _trained(log: str) -> int:
    """How many experiment task runs a worker's log says it finished (Prefect logs one line each;
    the sweep's other tasks, its clock and truth, are not experiments)."""
    return len(re.findall(r"Task run '(?:bs|adaptive)[^']*' - Finished in state Completed", log))


def _completed(setup: Setup, worker: str) -> int:
    """How many experiment task runs this worker has finished."""
    return _trained(setup.cluster.log(worker))


def _children(setup: Setup, folder: Path) -> tuple[Any, list[Any]]:
    parent_id = json.loads((folder / "sweep" / "state.json").read_text())["parent_run_id"]
    client = MlflowClient(setup.mlflow.uri)
    experiment = client.get_experiment_by_name("dask-sweep")
    children = client.search_runs([experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    return client.get_run(parent_id), children


@pytest.mark.e2e
def test_dask_sweep_equals_the_local_sweep_with_one_child_run_per_experiment(setup: Setup, tmp_path: Path) -> None:
    folder = _sweep_dir(setup, "equal")
    _sweep(folder, setup.env)

    assert_f1_equals_the_local_executor(folder, tmp_path)
    parent, children = _children(setup, folder)
    assert parent.info.status == "FINISHED"
    assert sorted((c.info.run_name, c.info.status) for c in children) == [
        ("sweep-bs16-seed0", "FINISHED"),
        ("sweep-bs32-seed0", "FINISHED"),
    ]
    # each worker ran one: w1 in the sweep's folder, w2 in its clone on data it pulled from the remote
    assert (setup.clone / "data" / "prepared" / "dataset.json").is_file()
    ran_in_clone = list((setup.clone / "sweep" / "experiments").glob("*/result.json"))
    assert len(ran_in_clone) == 1
    # every result is in the sweep's own folder, where a resume looks for it
    assert len(list((folder / "sweep" / "experiments").glob("*/result.json"))) == 2


@pytest.mark.e2e
def test_local_cbs_branches_run_as_tasks_on_the_workers_and_read_as_the_local_executors(
    setup: Setup, tmp_path: Path
) -> None:
    """sweep.local_cbs on the cluster, seeds apart (sweep.vectorize_seeds false): each seed's
    branches are a task run (w2's in its own clone), kept in the sweep's folder, and the report's
    figures are the local executor's."""
    branching = {"seeds": [0, 1], "local_cbs": True, "local_cbs_points": [0.5], "local_cbs_multipliers": [1, 2],
                 "vectorize_seeds": False}  # fmt: skip
    folder = _sweep_dir(setup, "branched", **branching)
    _sweep(folder, setup.env)
    ran = setup.cluster.log("w1") + setup.cluster.log("w2")
    assert "local-cbs-seed0" in ran and "local-cbs-seed1" in ran  # task runs on the workers
    for seed in (0, 1):  # kept where a resume and the report look, wherever it ran
        assert (folder / f"sweep/local_cbs/seed{seed}/branches.json").is_file()
    local = tmp_path / "local"
    shutil.copytree(folder / "data", local / "data")
    params = yaml.safe_load((folder / "params.yaml").read_text())
    write_params(local, merge(params, {"sweep": {"executor": "local"}, "tracking": {"enabled": False}}))
    run_sweep(load_config(local / "params.yaml"), Paths(local))
    figures = [json.loads((f / "reports/sweep/sweep.json").read_text()) for f in (folder, local)]
    branched = [{k: v for k, v in f.items() if k.startswith("local_cbs.")} for f in figures]
    assert branched[0] and branched[0].keys() == branched[1].keys()
    for key, value in branched[1].items():
        assert branched[0][key] == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), key


@pytest.mark.e2e
def test_worker_killed_mid_experiment_reruns_it_on_the_other_worker(setup: Setup, tmp_path: Path) -> None:
    _w2(setup)
    shutil.rmtree(setup.clone / "sweep", ignore_errors=True)  # what earlier tests left in w2's checkout
    folder = _sweep_dir(setup, "killed", epochs=30)
    with open(folder / "sweep.log", "w") as log:
        proc = subprocess.Popen(["batchlab", "sweep"], cwd=folder, env=setup.env, stdout=log, stderr=log)
    try:
        # w2 trains in its clone: the run's sidecar appears when its MLflow run opens, and the kill
        # follows within a poll (0.2 s) of it, seconds before its 30 epochs could end
        wait_until(
            lambda: list((setup.clone / "sweep" / "experiments").glob("*/.batchlab/checkpoints/train.pt.run")),
            "w2 to start an experiment",
            process=proc,
            log=folder / "sweep.log",
        )
        setup.cluster.kill("w2")
        assert proc.wait(timeout=600) == 0, (folder / "sweep.log").read_text()[-5000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not list((setup.clone / "sweep" / "experiments").glob("*/result.json"))  # killed before it finished
    parent, children = _children(setup, folder)
    assert parent.info.status == "FINISHED"
    finished = sorted(c.info.run_name for c in children if c.info.status == "FINISHED")
    assert finished == ["sweep-bs16-seed0", "sweep-bs32-seed0"]  # no duplicate for the rerun experiment
    assert sorted(c.info.status for c in children) == ["FINISHED", "FINISHED", "KILLED"]  # the killed attempt
    assert_f1_equals_the_local_executor(folder, tmp_path)


@pytest.mark.e2e
def test_worker_killed_after_finishing_an_experiment_is_not_trained_again(setup: Setup, tmp_path: Path) -> None:
    """w1 paused, so w2 finishes an experiment while the sweep still waits for the other, and dies
    with the result in its memory: Dask runs that task again on w1, which must find it finished."""
    _w2(setup)
    shutil.rmtree(setup.clone / "sweep", ignore_errors=True)
    folder = _sweep_dir(setup, "finished-then-killed")
    w1_before = _completed(setup, "w1")
    with open(folder / "sweep.log", "w") as log:
        proc = subprocess.Popen(["batchlab", "sweep"], cwd=folder, env=setup.env, stdout=log, stderr=log)
    try:
        # the sweep's first task, its clock, runs on either worker; w1 stops before the experiments start
        clock = folder / "sweep" / "throughput.json"
        wait_until(clock.is_file, "the sweep's clock", process=proc, log=folder / "sweep.log")
        setup.cluster.pause("w1")
        done = wait_until(
            lambda: list((setup.clone / "sweep" / "experiments").glob("*/result.json")),
            "w2 to finish an experiment",
            process=proc,
            log=folder / "sweep.log",
        )
        setup.cluster.kill("w2")
    finally:
        setup.cluster.resume("w1")
    try:
        assert proc.wait(timeout=600) == 0, (folder / "sweep.log").read_text()[-5000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    # w1 ran its own experiment and the task of w2's finished one again: wait for both, so that a
    # rerun that trained again would be in the store before the assertions read it
    wait_until(
        lambda: _completed(setup, "w1") >= w1_before + 2, "w1 to run both tasks", log=setup.cluster.folder / "w1.log"
    )
    parent, children = _children(setup, folder)
    assert parent.info.status == "FINISHED"
    assert sorted((c.info.run_name, c.info.status) for c in children) == [
        ("sweep-bs16-seed0", "FINISHED"),
        ("sweep-bs32-seed0", "FINISHED"),
    ]
    finished_on_w2 = json.loads(done[0].read_text())
    kept = json.loads((folder / "sweep" / "experiments" / finished_on_w2["name"] / "result.json").read_text())
    assert kept == finished_on_w2  # the stored result, not a second training's
    assert_f1_equals_the_local_executor(folder, tmp_path)


def _prepared(folder: Path) -> dict[str, Any]:
    """The repo's params with TINY's, and their data prepared in `folder`."""
    params = merge(yaml.safe_load((REPO / "params.yaml").read_text()), TINY)
    stages.generate(parse_config(params), Paths(folder))
    return params


@pytest.mark.e2e
def test_sqlite_tracking_is_refused_before_anything_runs(tmp_path: Path) -> None:
    params = _prepared(tmp_path)
    sqlite = {"enabled": True, "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    write_params(tmp_path, merge(params, {"tracking": sqlite, "sweep": {**SWEEP, "dask_address": "127.0.0.1:1"}}))
    proc = run(["batchlab", "sweep"], tmp_path, check=False)
    assert proc.returncode == 2
    error = proc.stderr.strip().splitlines()
    assert len(error) == 1 and "needs a tracking server" in error[0] and "sqlite:///" in error[0], proc.stderr
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "mlflow.db").exists()


def _no_tracking(params: dict[str, Any], address: str, **sweep: Any) -> dict[str, Any]:
    return merge(params, {"tracking": {"enabled": False}, "sweep": {**SWEEP, "dask_address": address, **sweep}})


@pytest.mark.e2e
def test_address_where_nothing_listens_is_refused_within_seconds(tmp_path: Path) -> None:
    params = _prepared(tmp_path)
    address = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    write_params(tmp_path, _no_tracking(params, address))
    proc = run(["batchlab", "sweep"], tmp_path, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"batchlab: error: the Dask scheduler at {address} did not answer within 5 s (nothing took the connection); "
        "start `dask scheduler` there or fix sweep.dask_address"
    ]
    assert not (tmp_path / "sweep").exists()


@pytest.mark.e2e
def test_scheduler_that_takes_the_connection_and_never_answers_is_given_up_after_5_s(tmp_path: Path) -> None:
    """A real `dask scheduler`, stopped (SIGSTOP): the kernel still accepts connections on its port,
    and nothing ever answers them. distributed's Client(timeout=5) waited there for ever."""
    params = _prepared(tmp_path)
    stuck = Cluster(tmp_path, env_with_venv())
    try:
        stuck.scheduler()
        stuck.pause("scheduler")
        write_params(tmp_path, _no_tracking(params, stuck.address))
        started = time.monotonic()
        cmd = ["batchlab", "sweep"]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env_with_venv(), capture_output=True, text=True, timeout=120)
        took = time.monotonic() - started
    finally:
        stuck.stop()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"batchlab: error: the Dask scheduler at {stuck.address} did not answer within 5 s (it took the connection "
        "and sent nothing back: a stopped or stuck scheduler, or another program's port); restart `dask scheduler` "
        "there or fix sweep.dask_address"
    ]
    assert took < 30, took  # the 5 s, plus the command's start on a loaded machine
    assert not (tmp_path / "sweep").exists()


@pytest.mark.e2e
def test_dask_address_that_is_not_an_address_is_one_line_naming_the_key(tmp_path: Path) -> None:
    """Refused by `batchlab validate` (the first stage of `dvc repro`), and by `batchlab sweep` before
    it reaches distributed (which raised a ValueError deep in its connect: a 60-line traceback)."""
    write_params(tmp_path, _no_tracking(_prepared(tmp_path), "not-an-address"))
    error = (
        "batchlab: error: sweep.dask_address must be a Dask scheduler's address, [tcp://]host:port as "
        "`dask scheduler` prints it (e.g. tcp://10.0.0.5:8786), got 'not-an-address'"
    )
    for stage in ("validate", "sweep"):
        proc = run(["batchlab", stage], tmp_path, check=False)
        assert (proc.returncode, proc.stderr.strip().splitlines()) == (2, [error]), (stage, proc.stderr[-3000:])
    assert not (tmp_path / "sweep").exists()


@pytest.mark.e2e
def test_scheduler_killed_mid_sweep_is_one_line_without_tracebacks_and_the_rerun_resumes(
    api: str, tmp_path: Path
) -> None:
    params = _prepared(tmp_path)
    env = env_with_venv(PREFECT_API_URL=api)
    results = tmp_path / "sweep" / "experiments"
    lost = Cluster(tmp_path, env)
    try:
        lost.scheduler()
        lost.worker("solo")  # one experiment at a time, in the sweep's own folder
        write_params(tmp_path, _no_tracking(params, lost.address, epochs=200))
        with open(tmp_path / "sweep.out", "w") as out, open(tmp_path / "sweep.err", "w") as err:
            proc = subprocess.Popen(["batchlab", "sweep"], cwd=tmp_path, env=env, stdout=out, stderr=err)
        wait_until(
            lambda: list(results.glob("*/result.json")),
            "an experiment to finish",
            process=proc,
            log=tmp_path / "sweep.err",
        )
        lost.kill("scheduler")  # while the other experiment trains
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        lost.stop()
    stderr = (tmp_path / "sweep.err").read_text()
    assert proc.returncode == 1, stderr[-5000:]
    assert "Traceback" not in stderr, stderr[-5000:]
    lines = stderr.strip().splitlines()
    # which of Dask's errors reports the loss first depends on timing: a cancelled future, or the
    # client's closed stream
    error = re.compile(
        rf"batchlab: error: lost the Dask scheduler at {re.escape(lost.address)} mid-sweep "
        r"\((FutureCancelledError|CommClosedError)\); the finished experiments are kept: run the sweep again to resume"
    )
    said = [line for line in lines if line.startswith("batchlab: error:")]
    assert said == lines[-1:] and error.fullmatch(said[0]), stderr[-5000:]
    # as it says: the rerun, on a scheduler that answers, trains only the experiment that did not finish
    (kept,) = results.glob("*/result.json")
    kept_bytes = kept.read_bytes()
    again = Cluster(tmp_path, env)
    try:
        again.scheduler()
        again.worker("solo")
        write_params(tmp_path, _no_tracking(params, again.address, epochs=200))
        rerun = run(["batchlab", "sweep"], tmp_path, check=False, PREFECT_API_URL=api)
    finally:
        again.stop()
    assert rerun.returncode == 0, rerun.stderr[-5000:]
    assert "sweep: resuming, 1 of 2 experiments already finished" in rerun.stderr, rerun.stderr[-5000:]
    assert kept.read_bytes() == kept_bytes and len(list(results.glob("*/result.json"))) == 2


def _documented_re_measure() -> str:
    """The re-measure command docs/sweep.md gives for `dvc exp run`, with PATH's batchlab and dvc."""
    (command,) = re.findall(
        r"`([^`]*dvc commit -f sweep[^`]*dvc exp run[^`]*)`", (REPO / "docs" / "sweep.md").read_text()
    )
    return command.replace(".venv/bin/", "")


@pytest.mark.e2e
def test_re_measuring_through_dvc_exp_run_reaches_the_cluster(api: str, tmp_path: Path) -> None:
    repo = copy_repo(tmp_path / "repo")
    params = merge(yaml.safe_load((repo / "params.yaml").read_text()), TINY)  # what runs where is the point
    write_params(repo, merge(params, {"sweep": {"batch_sizes": [16, 32], "seeds": [0]}}))
    run(["dvc", "repro", "-q", "sweep"], repo)  # measured here, with the local executor
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "swept"], repo)
    cluster = Cluster(tmp_path, env_with_venv(PREFECT_API_URL=api))
    try:
        cluster.scheduler()
        cluster.worker("solo")  # in the repo's own folder
        on_cluster = f"-S sweep.executor=dask -S sweep.dask_address={cluster.address}"
        # what the user did: DVC brings the deleted sweep/ back from its cache, and nothing is trained
        plain = run(["bash", "-c", f"rm -rf sweep && dvc exp run {on_cluster}"], repo, PREFECT_API_URL=api)
        # the same sweep (where it runs is not part of its key): already reported, nothing to log again
        assert "sweep: all 2 experiments already finished; nothing to do" in plain.stderr, plain.stderr[-5000:]
        assert cluster.log("solo").count("Finished in state Completed") == 0  # no task of any kind
        again = run(["bash", "-c", f"{_documented_re_measure()} {on_cluster}"], repo, PREFECT_API_URL=api)
        tasks = _trained(cluster.log("solo"))
    finally:
        cluster.stop()
    assert "resuming" not in again.stderr and "already finished" not in again.stderr, again.stderr[-5000:]
    assert tasks == 2, cluster.log("solo")[-5000:]  # both experiments, trained on the cluster's worker
    assert len(list((repo / "sweep" / "experiments").glob("*/result.json"))) == 2


@pytest.mark.e2e
def test_worker_with_other_batchlab_and_data_is_refused_naming_both(setup: Setup, tmp_path: Path) -> None:
    # another installation of batchlab (a version bump) and a checkout whose data came from other params
    other_src = tmp_path / "other-src"
    shutil.copytree(Path(stages.__file__).parent, other_src / "batchlab")
    init = other_src / "batchlab" / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "0.1.0"', '__version__ = "0.1.1"'))
    other_root = tmp_path / "other-root"
    other_root.mkdir()
    write_params(other_root, merge(TINY, {"data": {"seed": 7}}))
    run(["batchlab", "generate"], other_root)
    odd = Cluster(tmp_path, {**setup.env, "PYTHONPATH": str(other_src)})
    try:
        odd.scheduler()
        odd.worker("odd", BATCHLAB_WORKER_ROOT=str(other_root))
        folder = _sweep_dir(setup, "odd", dask_address=odd.address, batch_sizes=[16])
        proc = _sweep(folder, setup.env, check=False)
    finally:
        odd.stop()
    assert proc.returncode == 1, proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("batchlab: error:")]
    assert len(error) == 1, proc.stderr[-3000:]
    assert "differs from the sweep: batchlab 0.1.1 (sweep: 0.1.0)" in error[0]
    assert "data content hash" in error[0] and "source hash" in error[0]
    assert not list((folder / "sweep" / "experiments").glob("*/result.json"))


@pytest.mark.e2e
def test_a_sweep_without_a_prefect_server_is_one_line_and_starts_no_server_anywhere(setup: Setup) -> None:
    """Without PREFECT_API_URL the sweep would start Prefect's temporary server, and every worker one
    of its own (it outlived a killed worker, 40 minutes later): refused before anything starts."""
    folder = _sweep_dir(setup, "no-prefect-api")
    env = {k: v for k, v in setup.env.items() if k != "PREFECT_API_URL"}
    before = {p.pid for p in psutil.process_iter()}
    proc = _sweep(folder, env, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "batchlab: error: sweep.executor: dask needs a Prefect server the workers report to: set PREFECT_API_URL "
        "(e.g. http://host:4200/api of a `prefect server start`); without it every worker would start a "
        "temporary server of its own"
    ]
    started = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.info["pid"] not in before and "prefect.server.api.server" in " ".join(p.info["cmdline"] or []):
            started.append(p.info["cmdline"])
    assert not started and not (folder / "sweep").exists()
