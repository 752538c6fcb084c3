"""Scheduled runs end to end: a real `prefect server`, `flows/serve.py` serving, a triggered run."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient
from prefect.deployments import run_deployment
from prefect.settings import PREFECT_API_URL, temporary_settings

from tests.support import env_with_venv, prefect_call, prefect_server, set_params, wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture
def prefect_api(tmp_path: Path) -> Iterator[str]:
    """`prefect server start` on a free 127.0.0.1 port with its own home (SQLite)."""
    with prefect_server(tmp_path) as api:
        yield api


def test_scheduled_deployment_is_stored_and_a_triggered_run_completes(repo_copy: Path, prefect_api: str) -> None:
    set_params(repo_copy, "tracking", enabled=True)
    env = env_with_venv(
        PREFECT_API_URL=prefect_api,
        PREFECT_HOME=str(repo_copy / ".prefect"),
        PREFECT_RUNNER_POLL_FREQUENCY="2",
        BATCHLAB_TIMEZONE="Europe/Amsterdam",
    )
    log = open(repo_copy / "serve.log", "w")  # noqa: SIM115
    serving = subprocess.Popen(["python", "flows/serve.py"], cwd=repo_copy, env=env, stdout=log, stderr=log)
    try:
        # serve() registers the deployments one after the other: wait for each one read here
        pipeline, sweep = (
            wait_until(
                lambda name=name: prefect_call(prefect_api, lambda c: c.read_deployment_by_name(name)),
                f"deployment {name}",
                interval=1,
                process=serving,
                log=repo_copy / "serve.log",
            )
            for name in ("batchlab-pipeline/nightly", "batchlab-sweep/weekly")
        )
        schedule = pipeline.schedules[0].schedule
        assert (schedule.cron, schedule.timezone) == ("0 2 * * *", "Europe/Amsterdam")
        assert pipeline.parameters == {"params": "params.yaml", "root": "."}
        assert sweep.schedules[0].schedule.cron == "0 3 * * 0"

        with temporary_settings(updates={PREFECT_API_URL: prefect_api}):
            flow_run = run_deployment("batchlab-pipeline/nightly", timeout=0)

        def final_state() -> Any:
            state = prefect_call(prefect_api, lambda c: c.read_flow_run(flow_run.id)).state
            return state if state.is_final() else None

        state = wait_until(
            final_state,
            "the triggered flow run to finish",
            timeout=480,
            interval=2,
            process=serving,
            log=repo_copy / "serve.log",
        )
        assert state.is_completed(), f"{state}\n{(repo_copy / 'serve.log').read_text()[-4000:]}"
    finally:
        serving.terminate()
        serving.wait(timeout=60)
        log.close()

    client = MlflowClient(f"sqlite:///{repo_copy / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("batchlab").experiment_id])
    linked = [r for r in runs if r.data.tags.get("prefect.flow_run_id") == str(flow_run.id)]
    assert len(linked) == 1 and linked[0].info.status == "FINISHED"
    assert linked[0].data.metrics["test_f1_macro"] > 0.8
    assert os.path.exists(repo_copy / "models/model.onnx")
