"""Many trainings at once against one MLflow server on PostgreSQL, as a team's sweep meets it:
whatever they create or tag in common (the experiment, the dataset inputs, registered versions and
the champion alias, a dead run's end) is written once, no run dies from the race, and a server
restart in the middle loses no point."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import pytest
from mlflow import MlflowClient

from tests.support import env_with_venv, mlflow_on_postgres, run, set_params, wait_until

pytestmark = pytest.mark.e2e
RUNS, EPOCHS = 6, 12


def _start(repo: Path, out: str, uri: str) -> subprocess.Popen[str]:
    env = env_with_venv(MLFLOW_TRACKING_URI=uri)
    cmd = ["batchlab", "--out", out, "train"]
    return subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_six_trainings_at_once_lose_no_run_and_no_point_through_a_server_restart(
    repo_copy: Path, tmp_path: Path
) -> None:
    set_params(repo_copy, "tracking", enabled=True)
    set_params(repo_copy, "train", epochs=EPOCHS, batch_size=8)
    run(["batchlab", "generate"], repo_copy)
    with mlflow_on_postgres(tmp_path) as server:
        # a fresh store: the experiment and the dataset rows do not exist yet, and all six create them
        procs = [_start(repo_copy, f"out{i}", server.uri) for i in range(RUNS)]
        client = MlflowClient(server.uri)

        def a_run_has_epochs() -> bool | None:
            experiment = client.get_experiment_by_name("batchlab")
            if experiment is None:
                return None
            runs = client.search_runs([experiment.experiment_id])
            return any(len(client.get_metric_history(r.info.run_id, "val_loss")) >= 1 for r in runs) or None

        wait_until(a_run_has_epochs, "a training to record an epoch", interval=0.2, process=procs[0])
        server.kill()  # mid-run: the trainings keep what they cannot write
        time.sleep(5)
        server.start()
        outputs = [p.communicate(timeout=600)[0] for p in procs]
        assert [p.returncode for p in procs] == [0] * RUNS, "\n\n".join(o[-3000:] for o in outputs)
        assert not any("Traceback" in o for o in outputs), "\n\n".join(outputs)
        experiments = [e for e in client.search_experiments() if e.name == "batchlab"]
        assert len(experiments) == 1
        runs = client.search_runs([experiments[0].experiment_id])
        ids = {json.loads((repo_copy / f"out{i}/reports/train.json").read_text())["run_id"] for i in range(RUNS)}
        assert {r.info.run_id for r in runs} == ids and all(r.info.status == "FINISHED" for r in runs)
        for r in runs:
            for key in ("val_loss", "train_loss", "samples_per_s"):
                assert [m.step for m in client.get_metric_history(r.info.run_id, key)] == list(range(1, EPOCHS + 1))
            assert sorted(d.dataset.name for d in r.inputs.dataset_inputs) == [
                "synthetic-test", "synthetic-train", "synthetic-val"
            ]  # fmt: skip


def test_six_runs_logging_the_same_dataset_at_a_barrier_on_postgresql_all_log_it(tmp_path: Path) -> None:
    """The race one try in four hit with 12 trainings: MLflow's server adds a dataset as "look it
    up, insert it if absent", and six runs released at once all insert it."""
    import multiprocessing

    from tests.support.dataset_race import log_the_dataset_at_once

    with mlflow_on_postgres(tmp_path) as server:
        context = multiprocessing.get_context("spawn")
        barrier, answers = context.Barrier(RUNS), context.Queue()
        racers = [
            context.Process(target=log_the_dataset_at_once, args=(server.uri, barrier, answers)) for _ in range(RUNS)
        ]
        for racer in racers:
            racer.start()
        for racer in racers:
            racer.join(timeout=300)
        assert [answers.get(timeout=10) for _ in racers] == ["ok"] * RUNS
        client = MlflowClient(server.uri)
        runs = client.search_runs([client.get_experiment_by_name("batchlab").experiment_id])
        assert sum(len(r.inputs.dataset_inputs) == 3 for r in runs if r.info.run_name == "racer") == RUNS
        log = (tmp_path / "server.log").read_text()
        raced = log.count("UniqueViolation")
        print(f"the server turned down {raced} duplicate dataset inserts")


class _Constant(mlflow.pyfunc.PythonModel):
    def predict(self, context: Any, model_input: list[Any]) -> list[Any]:
        return model_input


def _register_at_once(uri: str, source: str, score: float, barrier: Any, answers: Any) -> None:
    """One export's registration: wait for the others, then add a version scored `score`."""
    from batchlab import tracking
    from batchlab.tracking import registry

    tracking.quiet_mlflow()
    client = MlflowClient(uri)
    try:
        mlflow.set_tracking_uri(uri)
        barrier.wait()
        answers.put((score, *registry.register(client, "racers", source, {"f1": f"{score:.6f}"}, "f1")))
    except Exception as err:  # the answer the parent asserts on
        answers.put((score, f"{type(err).__name__}: {str(err)[:200]}", False))


def test_eight_exports_registering_at_once_get_eight_versions_and_the_best_is_champion(tmp_path: Path) -> None:
    """Eight registrations released at a barrier: each gets its own version (MLflow's number
    clash is tried again) and the champion alias ends on the best score, whatever order the
    reads and writes of the alias interleave in (without settling, the last writer won)."""
    import multiprocessing

    from batchlab import tracking

    scores = [0.61, 0.93, 0.72, 0.55, 0.88, 0.97, 0.64, 0.80]
    with mlflow_on_postgres(tmp_path) as server:
        client = MlflowClient(server.uri)
        mlflow.set_tracking_uri(server.uri)
        with mlflow.start_run(experiment_id=client.create_experiment("exports")) as made:
            mlflow.pyfunc.log_model(name="model", python_model=_Constant(), pip_requirements=[])
        source = f"runs:/{made.info.run_id}/model"  # one logged model, registered eight times
        context = multiprocessing.get_context("spawn")
        barrier, answers = context.Barrier(len(scores)), context.Queue()
        racers = [
            context.Process(target=_register_at_once, args=(server.uri, source, s, barrier, answers)) for s in scores
        ]
        for racer in racers:
            racer.start()
        got = sorted(answers.get(timeout=300) for _ in racers)
        for racer in racers:
            racer.join(timeout=60)
        assert all(version.isdigit() for _, version, _ in got), got
        assert sorted(int(version) for _, version, _ in got) == list(range(1, len(scores) + 1))
        champion = client.get_model_version_by_alias("racers", tracking.CHAMPION)
        best = max(got)
        assert champion.version == best[1] and champion.tags["f1"] == f"{max(scores):.6f}"
        assert best[2], "the best export is told its version is the champion"


def test_eight_commands_ending_the_same_dead_runs_at_once_all_start(tmp_path: Path) -> None:
    """Each run's start ends the RUNNING runs that a dead process of its host left, tagging each:
    commands started together after a crash all tag the same runs, and on PostgreSQL MLflow's tag
    upsert races (duplicate key on tag_pk: 4 of the 8 starters here died of it before). Eight starters on
    threads (each its own client, so the server sees them at once) released at a barrier."""
    import threading

    from batchlab.tracking import ownership
    from batchlab.tracking.base import REAPED
    from batchlab.tracking.lifecycle import _end_orphans

    dead = subprocess.Popen(["true"])
    dead.wait()
    with mlflow_on_postgres(tmp_path) as server:
        client = MlflowClient(server.uri)
        experiment = client.create_experiment("team")
        owner = ownership.owner_tags() | {ownership.PID: str(dead.pid)}
        orphans = [client.create_run(experiment, tags=owner).info.run_id for _ in range(5)]
        barrier, errors = threading.Barrier(8), []

        def start() -> None:
            mine = MlflowClient(server.uri)
            barrier.wait()
            try:
                _end_orphans(mine, experiment)
            except Exception as err:  # what the assert reports
                errors.append(str(err)[:300])

        starters = [threading.Thread(target=start) for _ in range(8)]
        for starter in starters:
            starter.start()
        for starter in starters:
            starter.join(timeout=300)
        assert errors == []
        for run_id in orphans:
            ended = client.get_run(run_id)
            assert ended.info.status == "KILLED" and "exited without ending the run" in ended.data.tags[REAPED]
