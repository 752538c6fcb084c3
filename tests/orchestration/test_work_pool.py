"""Prefect for teams: the scheduled deployments stored on a process work pool, and a real
`prefect worker` process (as on another machine) picking up a triggered run from a real server."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from prefect.deployments import run_deployment
from prefect.settings import PREFECT_API_URL, temporary_settings

from tests.support import env_with_venv, prefect_call, prefect_server, run, stop_group, wait_until

pytestmark = pytest.mark.e2e


def test_deploying_to_an_api_that_does_not_answer_is_one_line_and_exit_1(repo_copy: Path, tmp_path: Path) -> None:
    env = {"PREFECT_API_URL": "http://127.0.0.1:9/api", "PREFECT_HOME": str(tmp_path / "home")}  # port 9: discard
    proc = run(["python", "flows/serve.py", "--pool", "batchlab"], repo_copy, check=False, **env)
    assert proc.returncode == 1, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("serve.py: error: the Prefect API at http://127.0.0.1:9/api did not answer"), line


def test_a_worker_on_the_work_pool_runs_a_triggered_scheduled_deployment(repo_copy: Path, tmp_path: Path) -> None:
    with prefect_server(tmp_path) as api:
        env = {"PREFECT_API_URL": api, "PREFECT_HOME": str(tmp_path / "client-home")}
        missing = run(["python", "flows/serve.py", "--pool", "batchlab"], repo_copy, check=False, **env)
        assert missing.returncode == 1 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
        assert "no work pool 'batchlab'" in missing.stderr and "prefect work-pool create batchlab" in missing.stderr
        run(["prefect", "work-pool", "create", "batchlab", "--type", "process"], repo_copy, **env)
        deployed = run(["python", "flows/serve.py", "--pool", "batchlab"], repo_copy, **env).stdout
        assert "deployed batchlab-pipeline/nightly to work pool 'batchlab'" in deployed
        assert "deployed batchlab-sweep/weekly to work pool 'batchlab'" in deployed
        pipeline = prefect_call(api, lambda c: c.read_deployment_by_name("batchlab-pipeline/nightly"))
        assert pipeline.work_pool_name == "batchlab" and pipeline.schedules[0].schedule.cron == "0 2 * * *"

        worker_env = env_with_venv(
            PREFECT_API_URL=api, PREFECT_HOME=str(tmp_path / "worker-home"), PREFECT_WORKER_QUERY_SECONDS="2"
        )
        log = tmp_path / "worker.log"
        with open(log, "w") as out:
            cmd = ["prefect", "worker", "start", "--pool", "batchlab", "--type", "process"]
            worker = subprocess.Popen(
                cmd, cwd=tmp_path, env=worker_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            with temporary_settings(updates={PREFECT_API_URL: api}):
                flow_run = run_deployment("batchlab-pipeline/nightly", timeout=0)

            def final_state() -> Any:
                state = prefect_call(api, lambda c: c.read_flow_run(flow_run.id)).state
                return state if state.is_final() else None

            state = wait_until(final_state, "the worker to finish the run", interval=2, process=worker, log=log)
            assert state.is_completed(), f"{state}\n{log.read_text()[-4000:]}"
        finally:
            stop_group(worker)
    assert str(flow_run.id) in log.read_text()  # this worker ran it, not anything else
    assert (repo_copy / "models/model.onnx").is_file()  # in the checkout the deployment names
