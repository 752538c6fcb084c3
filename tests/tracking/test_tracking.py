"""MLflow tracking against real backends: a SQLite file, and `mlflow server` on PostgreSQL."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from mlflow import MlflowClient

from batchlab import stages, tracking
from batchlab.config import Config, TrackingConfig
from batchlab.paths import Paths
from tests.support import (
    WAIT_S,
    MlflowServer,
    env_with_venv,
    mlflow_on_postgres,
    run,
    set_params,
    tiny_config,
    wait_until,
)
from tests.support.dataset_race import log_the_dataset_at_once
from tests.support.models import waiting_model

pytestmark = pytest.mark.integration  # MLflow stores written in this process (SQLite), or servers: e2e

ON = {"enabled": True, "experiment": "test", "registered_model": "tiny-mlp"}


def _uri(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def _pipeline(cfg: Config, root: Path) -> str:
    paths = Paths(root)
    stages.generate(cfg, paths)
    info = stages.train(cfg, paths)
    stages.evaluate(cfg, paths)
    stages.export(cfg, paths)
    return str(info["run_id"])


def test_one_run_holds_params_epochs_evaluation_models_and_lineage(workdir: Path) -> None:
    cfg = tiny_config(tracking={**ON, "tracking_uri": _uri(workdir)})
    run_id = _pipeline(cfg, workdir)
    # nothing of the run stays in the environment, where a process started later would take it up
    assert "MLFLOW_TRACKING_URI" not in os.environ and "MLFLOW_EXPERIMENT_ID" not in os.environ
    client = MlflowClient(_uri(workdir))
    runs = client.search_runs([client.get_experiment_by_name("test").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]  # evaluate and export logged into train's run
    r = runs[0]
    assert r.info.status == "FINISHED"
    assert r.data.params["train.batch_size"] == "32" and r.data.params["model.hidden_sizes"] == "[16]"
    assert len(r.data.params) == len(cfg.flat())
    history = client.get_metric_history(run_id, "val_loss")
    assert [m.step for m in history] == [1, 2, 3, 4]
    for key in ("train_loss", "val_accuracy", "samples_per_s", "epoch_seconds", "peak_memory_mb"):
        assert len(client.get_metric_history(run_id, key)) == 4, key
    metrics = json.loads((workdir / "reports/metrics.json").read_text())
    assert r.data.metrics["test_f1_macro"] == pytest.approx(metrics["f1_macro"])
    for key in ("test_accuracy", "test_precision_weighted", "test_recall_1", "test_roc_auc", "export_max_abs_diff"):
        assert key in r.data.metrics, key
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"history.csv", "evaluation", "export"} <= artifacts
    assert {a.path for a in client.list_artifacts(run_id, "evaluation")} == {
        "evaluation/metrics.json",
        "evaluation/confusion.png",
    }
    models = {m.name for m in client.search_logged_models([r.info.experiment_id])}
    assert models == {"torch_model", "onnx_model", "predictor"}  # predictor: class + probabilities (pyfunc)
    digest = json.loads((workdir / "data/prepared/dataset.json").read_text())["content_hash"]
    contexts = {i.tags[0].value: i.dataset.digest for i in r.inputs.dataset_inputs}
    assert contexts == {"train": digest, "val": digest, "test": digest}
    assert r.data.tags["train.strategy"] == "single" and r.data.tags["train.world_size"] == "1"
    assert {"host", "torch.version"} <= set(r.data.tags)
    champion = client.get_model_version_by_alias("tiny-mlp", tracking.CHAMPION)
    assert champion.run_id == run_id


def test_champion_alias_moves_only_when_f1_beats_the_champion(workdir: Path) -> None:
    base = {"tracking": {**ON, "tracking_uri": _uri(workdir)}}
    weak = {**base, "train": {"epochs": 1, "lr": 1e-5}}
    _pipeline(tiny_config(**weak), workdir)
    good = _pipeline(tiny_config(**base), workdir)
    _pipeline(tiny_config(**weak), workdir)
    client = MlflowClient(_uri(workdir))
    versions = client.search_model_versions("name='tiny-mlp'")
    assert len(versions) == 3
    champion = client.get_model_version_by_alias("tiny-mlp", tracking.CHAMPION)
    assert champion.run_id == good and str(champion.version) == "2"


def test_an_exception_ends_the_run_failed_with_the_error(workdir: Path) -> None:
    cfg = TrackingConfig(**{**ON, "tracking_uri": _uri(workdir)})
    with pytest.raises(ZeroDivisionError), tracking.run(cfg) as tracker:
        run_id = tracker.run_id
        1 / 0  # noqa: B018
    r = MlflowClient(_uri(workdir)).get_run(str(run_id))
    assert r.info.status == "FAILED"
    assert r.data.tags["error"] == "ZeroDivisionError: division by zero"


def test_system_metrics_are_sampled_when_enabled(workdir: Path) -> None:
    cfg = TrackingConfig(**{**ON, "tracking_uri": _uri(workdir), "system_metrics": True})
    client = MlflowClient(_uri(workdir))
    with tracking.run(cfg) as tracker:
        run_id = str(tracker.run_id)

        def sampled() -> bool:  # the sampler writes every 2 s: however slow the machine, wait for it
            keys = client.get_run(run_id).data.metrics
            return all(any(k.startswith(f"system/{m}") for k in keys) for m in ("cpu_utilization", "system_memory"))

        wait_until(sampled, "system metrics in the run", interval=0.5)
    keys = client.get_run(run_id).data.metrics  # and still there once the run has ended
    assert any(k.startswith("system/cpu_utilization") for k in keys), sorted(keys)
    assert any(k.startswith("system/system_memory_usage") for k in keys), sorted(keys)


def test_sigterm_ends_the_run_killed(repo_copy: Path) -> None:
    set_params(repo_copy, "tracking", enabled=True)
    set_params(repo_copy, "train", epochs=500, batch_size=16)
    run(["batchlab", "generate"], repo_copy)
    # the store made first: a client created as the training creates it raced MLflow's schema
    # creation (CI: "table sql_trace_metric_daily_rollups already exists")
    client = MlflowClient(f"sqlite:///{repo_copy / 'mlflow.db'}")
    client.search_experiments()
    proc = subprocess.Popen(["batchlab", "train"], cwd=repo_copy, env=env_with_venv(), stderr=subprocess.PIPE)

    def logging_epochs() -> list[Any]:
        runs = client.search_runs([client.get_experiment_by_name("batchlab").experiment_id])
        return [r for r in runs if "val_loss" in r.data.metrics]

    runs = wait_until(logging_epochs, "a run logging epochs", interval=0.5, process=proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 130
    assert client.get_run(runs[0].info.run_id).info.status == "KILLED"


def test_unreachable_server_is_reported_before_training(repo_copy: Path) -> None:
    set_params(repo_copy, "tracking", enabled=True)
    run(["batchlab", "generate"], repo_copy)
    proc = run(["batchlab", "train"], repo_copy, check=False, MLFLOW_TRACKING_URI="http://127.0.0.1:9")
    assert proc.returncode == 1
    assert "MLflow tracking server http://127.0.0.1:9 is unreachable" in proc.stderr
    assert "tracking.enabled: false" in proc.stderr
    assert "epoch" not in proc.stderr and not (repo_copy / "models/model.pt").exists()


@pytest.mark.parametrize(
    "command",
    [
        ["verify"],
        ["reproduce", "0123456789abcdef"],
        ["predict", "--model", "models:/batchlab-mlp@champion", "--input", "rows.csv"],
    ],
    ids=["verify", "reproduce", "predict"],
)
def test_commands_that_read_runs_stop_in_one_line_when_the_server_is_down(repo_copy: Path, command: list[str]) -> None:
    """Not MLflow's ~4 minutes of retries (verify printed a 123-line traceback after 248 s)."""
    set_params(repo_copy, "tracking", enabled=True)
    (repo_copy / "reports/train.json").write_text('{"run_id": "0123456789abcdef"}')
    (repo_copy / "rows.csv").write_text("x0\n1.0\n")
    proc = run(["batchlab", *command], repo_copy, check=False, MLFLOW_TRACKING_URI="http://127.0.0.1:9")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "batchlab: error: MLflow tracking server http://127.0.0.1:9 is unreachable (ConnectionError); start it, "
        "or set MLFLOW_TRACKING_URI / tracking.tracking_uri, or set tracking.enabled: false"
    ], proc.stderr


WRITER = textwrap.dedent(
    """
    import sys
    from batchlab import tracking
    from batchlab.config import TrackingConfig
    cfg = TrackingConfig(enabled=True, experiment="concurrent", tracking_uri=sys.argv[1])
    with tracking.run(cfg, name=sys.argv[2]) as t:
        t.log_params({f"p{i}": i for i in range(30)})
        for step in range(1, 31):
            t.log_epoch({"loss": 1 / step, "acc": step / 30}, step=step)
        t.set_tags({"writer": sys.argv[2]})
    """
)


def test_four_concurrent_writers_share_one_sqlite_file(tmp_path: Path) -> None:
    uri = _uri(tmp_path)
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, uri, f"w{i}"], stderr=subprocess.PIPE, text=True)
        for i in range(4)
    ]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], "\n".join(errors)
    assert not any("database is locked" in e for e in errors)
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("concurrent").experiment_id])
    assert sorted(r.data.tags["writer"] for r in runs) == ["w0", "w1", "w2", "w3"]
    assert all(r.info.status == "FINISHED" and len(r.data.params) == 30 for r in runs)
    assert all(len(client.get_metric_history(r.info.run_id, "loss")) == 30 for r in runs)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[MlflowServer]:
    """A started MlflowServer whose runs go to a fresh PostgreSQL database."""
    with mlflow_on_postgres(tmp_path) as running:
        yield running


@pytest.fixture
def mlflow_server(server: MlflowServer) -> str:
    return server.uri


@pytest.mark.e2e
def test_pipeline_logs_to_an_mlflow_server_on_postgresql(repo_copy: Path, mlflow_server: str) -> None:
    set_params(repo_copy, "tracking", enabled=True)
    for stage in ("generate", "train", "evaluate", "export"):
        proc = run(["batchlab", stage], repo_copy, MLFLOW_TRACKING_URI=mlflow_server)
        # one line per stage: not MLflow's "🏃 View run … at:" and "🧪 View experiment at:" after each run
        assert "View run" not in proc.stdout + proc.stderr and "View experiment" not in proc.stdout, proc.stdout
    run_id = json.loads((repo_copy / "reports/train.json").read_text())["run_id"]
    r = MlflowClient(mlflow_server).get_run(run_id)
    assert r.info.status == "FINISHED"
    assert r.data.metrics["test_f1_macro"] > 0.8
    assert r.data.params["train.epochs"] == "4"
    assert not (repo_copy / "mlflow.db").exists()  # the environment's URI won over params.yaml


ORPHAN = textwrap.dedent(
    """
    import os, signal, sys
    from batchlab import tracking
    from batchlab.config import TrackingConfig
    cfg = TrackingConfig(enabled=True, experiment="reap", tracking_uri=sys.argv[1])
    with tracking.run(cfg, name="orphan") as t:
        print(t.run_id, os.getpid(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_runs_left_running_by_a_dead_process_of_this_host_end_killed(workdir: Path) -> None:
    uri = _uri(workdir)
    proc = subprocess.run([sys.executable, "-c", ORPHAN, uri], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    orphan, pid = proc.stdout.split()
    client = MlflowClient(uri)
    assert client.get_run(orphan).info.status == "RUNNING"  # what SIGKILL leaves behind
    experiment = client.get_experiment_by_name("reap").experiment_id
    host, started = socket.gethostname(), psutil.Process().create_time()

    def owned_by(owner_host: str, owner_pid: int, owner_started: float) -> str:
        tags = {"batchlab.owner.host": owner_host, "batchlab.owner.pid": str(owner_pid),
                "batchlab.owner.started": f"{owner_started:.2f}"}  # fmt: skip
        return str(client.create_run(experiment, tags=tags).info.run_id)

    elsewhere = owned_by("elsewhere.invalid", int(pid), 1.0)  # maybe dead, but not ours to judge
    recycled = owned_by(host, os.getpid(), started - 3600)  # this pid, but not this process
    alive = owned_by(host, os.getpid(), started)

    with tracking.run(TrackingConfig(**{**ON, "experiment": "reap", "tracking_uri": uri})):
        pass
    status = {name: client.get_run(r).info.status for name, r in
              {"orphan": orphan, "recycled": recycled, "elsewhere": elsewhere, "alive": alive}.items()}  # fmt: skip
    assert status == {"orphan": "KILLED", "recycled": "KILLED", "elsewhere": "RUNNING", "alive": "RUNNING"}
    assert client.get_run(orphan).data.tags["batchlab.reaped"] == (
        f"owner pid {pid} on {host} exited without ending the run (killed?)"
    )
    assert "the pid was reused since" in client.get_run(recycled).data.tags["batchlab.reaped"]


def _checkpoint_epoch(checkpoint: Path) -> int:
    try:
        return int(torch.load(checkpoint, weights_only=True)["state"]["epoch"])
    except (FileNotFoundError, RuntimeError, EOFError):  # not written yet
        return 0


def _wait_for_epoch(proc: subprocess.Popen[str], checkpoint: Path, epoch: int, timeout: float = WAIT_S) -> None:
    wait_until(
        lambda: _checkpoint_epoch(checkpoint) >= epoch, f"a checkpoint of epoch {epoch}", timeout=timeout, process=proc
    )


def _steps(client: MlflowClient, run_id: str, key: str = "val_loss") -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_sigkilled_train_is_reaped_and_its_resumed_training_continues_the_same_run(repo_copy: Path) -> None:
    set_params(repo_copy, "tracking", enabled=True)
    set_params(repo_copy, "train", epochs=40, batch_size=16)
    run(["batchlab", "generate"], repo_copy)
    checkpoint = repo_copy / ".batchlab/checkpoints/train.pt"
    proc = subprocess.Popen(
        ["batchlab", "train"], cwd=repo_copy, env=env_with_venv(), stderr=subprocess.PIPE, text=True
    )
    _wait_for_epoch(proc, checkpoint, 3)
    proc.kill()  # SIGKILL: no handler runs, nothing ends the run
    proc.communicate()
    client = MlflowClient(f"sqlite:///{repo_copy / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("batchlab").experiment_id
    [killed] = client.search_runs([experiment])
    assert killed.info.status == "RUNNING"

    before = _steps(client, killed.info.run_id)  # what was written before the kill (a flush a second)

    resumed = run(["batchlab", "train"], repo_copy)
    assert "resuming from" in resumed.stderr
    [after] = client.search_runs([experiment])  # continued, not a second run
    assert after.info.run_id == killed.info.run_id
    assert json.loads((repo_copy / "reports/train.json").read_text())["run_id"] == killed.info.run_id
    assert after.info.status == "FINISHED"
    assert (
        after.data.tags["batchlab.reaped"]
        == f"owner pid {proc.pid} on {socket.gethostname()} exited without ending the run (killed?)"
    )
    assert f"ended run {killed.info.run_id} as KILLED: owner pid {proc.pid}" in resumed.stderr
    resumed_at = int(after.data.tags["batchlab.resumed_at_epoch"])
    assert resumed_at >= 3 and before == list(range(1, len(before) + 1))
    for key in ("val_loss", "train_loss", "val_accuracy"):
        assert _steps(client, killed.info.run_id, key) == list(range(1, 41)), key  # every epoch once, no gap
    assert not checkpoint.exists() and not (repo_copy / ".batchlab/checkpoints/train.pt.run").exists()


# ~0.4 s epochs (27 steps of a waiting MLP, models.WAITING): the server dies and returns while training
# runs, on little CPU (10,000 rows of the plain MLP made such epochs by computing: 120 of them kept a
# core busy for some 50 s; the restart test now takes 13 CPU-seconds alone, servers included)
STEP_PAUSE_MS = 15.0


def _train_then_kill_the_server(
    repo: Path, server: MlflowServer, epochs: int, final_wait_s: int
) -> tuple[subprocess.Popen[str], Path]:
    """`batchlab train` logging to `server`, which dies once epoch 2 is checkpointed."""
    set_params(repo, "tracking", enabled=True)
    set_params(repo, "model", **waiting_model(repo, STEP_PAUSE_MS))
    set_params(repo, "train", epochs=epochs, batch_size=16)
    run(["batchlab", "generate"], repo)
    checkpoint = repo / ".batchlab/checkpoints/train.pt"
    env = env_with_venv(MLFLOW_TRACKING_URI=server.uri, BATCHLAB_TRACKING_WAIT_S=str(final_wait_s))
    proc = subprocess.Popen(["batchlab", "train"], cwd=repo, env=env, stderr=subprocess.PIPE, text=True)
    _wait_for_epoch(proc, checkpoint, 2)
    server.kill()
    return proc, checkpoint


@pytest.mark.e2e
def test_training_outlives_a_tracking_server_restart_and_records_every_epoch(
    repo_copy: Path, server: MlflowServer
) -> None:
    # the end of the run waits up to 180 s for the server: it may take that long to start on a busy machine
    proc, checkpoint = _train_then_kill_the_server(repo_copy, server, epochs=120, final_wait_s=180)
    down_at = _checkpoint_epoch(checkpoint)
    # no epoch waits for the dead server: before, each write sat in MLflow's retries for ~4 min
    _wait_for_epoch(proc, checkpoint, down_at + 5, timeout=150)
    server.start()  # takes ~30 s here: training goes on meanwhile, or waits at its end if it got there
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert (repo_copy / "models/model.pt").is_file()
    assert f"tracking: {server.uri} is unreachable" in stderr and "answers again" in stderr
    assert "not recorded" not in stderr
    client = MlflowClient(server.uri)
    run_id = json.loads((repo_copy / "reports/train.json").read_text())["run_id"]
    r = client.get_run(run_id)
    assert r.info.status == "FINISHED"
    assert _steps(client, run_id) == list(range(1, 121))
    assert {a.path for a in client.list_artifacts(run_id)} >= {"history.csv"}


@pytest.mark.e2e
def test_a_tracking_server_that_stays_down_costs_no_model_and_its_metrics_are_sent_later(
    repo_copy: Path, server: MlflowServer
) -> None:
    proc, _ = _train_then_kill_the_server(repo_copy, server, epochs=12, final_wait_s=5)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert (repo_copy / "models/model.pt").is_file()
    run_id = json.loads((repo_copy / "reports/train.json").read_text())["run_id"]
    kept = repo_copy / ".batchlab/unrecorded" / f"{run_id}.json"
    [warning] = [line for line in stderr.splitlines() if "not recorded" in line]
    assert warning.startswith(
        f"batchlab: warning: tracking backend {server.uri} was unreachable; not recorded in run {run_id}: "
    )
    assert f"metric values (kept in .batchlab/unrecorded/{run_id}.json;" in warning
    assert "the model; history.csv; the end of the run (FINISHED)" in warning
    assert "Traceback" not in stderr
    assert kept.is_file()

    server.start()  # back later: the next command that opens the run sends what was kept
    run(["batchlab", "evaluate"], repo_copy, MLFLOW_TRACKING_URI=server.uri)
    client = MlflowClient(server.uri)
    assert _steps(client, run_id) == list(range(1, 13))
    r = client.get_run(run_id)
    assert r.info.status == "FINISHED" and "test_f1_macro" in r.data.metrics
    assert not kept.exists()


def test_run_names_say_what_started_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    monkeypatch.delenv("DVC_STAGE", raising=False)
    assert tracking.origin() == "cli"
    monkeypatch.setenv("DVC_STAGE", "train")  # what DVC sets for every stage command
    assert tracking.origin() == "dvc"
    monkeypatch.setenv("DVC_EXP_NAME", "gummy-tars")  # what `dvc exp run` adds
    assert tracking.origin() == "exp-gummy-tars"


def test_logging_a_torch_model_does_not_import_lightning(tmp_path: Path) -> None:
    """mlflow.pytorch imports Lightning whenever it is installed (3.9 s of every training here);
    a Lightning that fails on import proves batchlab's model logging never loads it."""
    fake = tmp_path / "site" / "pytorch_lightning"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise RuntimeError('Lightning was imported')\n")
    code = (
        "import sys; from batchlab.tracking.flavors import torch_flavor; "
        "assert torch_flavor().log_model and 'pytorch_lightning' not in sys.modules; print('flavor loaded'); "
        "import mlflow.pytorch._lightning_autolog"  # autolog still imports it on demand
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "flavor loaded" in done.stdout, done.stderr
    assert done.returncode != 0 and "Lightning was imported" in done.stderr  # by the explicit import only


def test_logging_a_model_skips_mlflows_scan_of_every_installed_package(tmp_path: Path) -> None:
    """MLflow maps every installed distribution's modules before logging a model (0.86 s per process
    here); a scan that fails proves batchlab's model logging skips it, and a pin the environment does
    not satisfy proves the requirements are still checked."""
    code = f"""
import importlib_metadata, mlflow
from mlflow.pyfunc import PythonModel
from mlflow.utils import requirements_utils as reqs
from batchlab.tracking.flavors import named_requirements

def refuse():
    raise RuntimeError("packages_distributions was called")

importlib_metadata.packages_distributions = refuse

class Echo(PythonModel):
    def predict(self, context, model_input):
        return model_input

mlflow.set_tracking_uri("sqlite:///{tmp_path / "mlflow.db"}")
with mlflow.start_run(), named_requirements():
    mlflow.pyfunc.log_model(name="m", python_model=Echo(), pip_requirements=["numpy==0.0.1", "mlflow"])
assert reqs._MODULES_TO_PACKAGES is None, "the map stays for the next caller to build"
print("logged")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert "logged" in done.stdout, (done.returncode, done.stderr)
    assert "required: numpy==0.0.1" in done.stderr  # MLflow's mismatch warning, as without the shim


def test_runs_logging_the_same_dataset_at_once_all_log_it(tmp_path: Path) -> None:
    # MLflow adds a dataset as "look it up, insert it if absent": 4 processes at a barrier all
    # insert, and without a retry 3 of them failed on the unique key (UNIQUE constraint failed:
    # datasets...), as a Prefect sweep's tasks did in CI
    import multiprocessing

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with tracking.run(TrackingConfig(enabled=True, tracking_uri=uri), name="creates-the-store"):
        pass
    context = multiprocessing.get_context("spawn")
    barrier, answers = context.Barrier(4), context.Queue()
    racers = [context.Process(target=log_the_dataset_at_once, args=(uri, barrier, answers)) for _ in range(4)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(timeout=300)
    assert [answers.get(timeout=10) for _ in racers] == ["ok"] * 4
    runs = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("batchlab").experiment_id])
    assert sum(len(r.inputs.dataset_inputs) == 3 for r in runs if r.info.run_name == "racer") == 4
