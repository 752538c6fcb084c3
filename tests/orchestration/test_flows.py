"""Prefect flows under Prefect's test harness (a temporary local server)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.testing.utilities import prefect_test_harness

from batchlab import orchestration, tracking
from batchlab.config import ConfigError
from batchlab.data import DataError
from batchlab.paths import Paths
from batchlab.sweep import lock
from tests.support import REPO, TINY, merge, run, wait_until, write_params

sys.path.insert(0, str(REPO / "flows"))
import pipeline as pipeline_flow
import sweep as sweep_flow

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def harness() -> Iterator[None]:
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracked = {"tracking": {"enabled": True, "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}}
    write_params(tmp_path, merge(TINY, tracked))
    return tmp_path


def _task_runs(flow_run_id: Any, expected: int = 1) -> dict[str, list[Any]]:
    """Task runs of a flow run by task name, once at least `expected` are recorded in final states:
    Prefect 3 records task-run states through events, a moment after the flow returns."""

    async def read() -> list[Any]:
        async with get_client() as client:
            return await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))

    import asyncio

    def settled() -> list[Any] | None:
        task_runs = asyncio.run(read())
        done = len(task_runs) >= expected and all(t.state is not None and t.state.is_final() for t in task_runs)
        return task_runs if done else None

    task_runs = wait_until(settled, f"{expected} task runs in final states", interval=0.5)
    runs: dict[str, list[Any]] = {}
    for task_run in task_runs:
        runs.setdefault(task_run.task_key.split("-")[0], []).append(task_run)
    return runs


def _artifact(key: str) -> str:
    async def read() -> Any:
        async with get_client() as client:
            from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

            return await client.read_latest_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))

    import asyncio

    return str(asyncio.run(read())[0].data)


def test_transient_errors_retry_and_config_errors_never_do() -> None:
    assert orchestration.is_transient(tracking.TrackingUnavailable("down"))
    assert orchestration.is_transient(ConnectionError())
    assert not orchestration.is_transient(ConfigError("train.lr: bad"))
    assert not orchestration.is_transient(DataError("NaN"))
    assert not orchestration.is_transient(ValueError())


def test_pipeline_flow_links_prefect_and_mlflow_and_caches_generation(root: Path) -> None:
    torch.set_num_threads(2)  # what this process had: the flow decides train.threads (1) as the CLI does
    state = pipeline_flow.pipeline(root=str(root), return_state=True)
    assert state.is_completed()
    assert json.loads((root / "reports/train.json").read_text())["torch_threads"] == 1
    out = state.result()
    flow_run_id = state.state_details.flow_run_id
    run_info = MlflowClient(f"sqlite:///{root / 'mlflow.db'}").get_run(out["run_id"])
    assert run_info.data.tags["prefect.flow_run_id"] == str(flow_run_id)
    assert run_info.info.run_name.startswith("prefect-") and "-train-bs" in run_info.info.run_name
    assert run_info.data.metrics["test_f1_macro"] == pytest.approx(out["metrics"]["f1_macro"])
    assert out["onnx_max_abs_diff"] <= 1e-4
    artifact = _artifact("batchlab-test-metrics")
    assert out["run_id"] in artifact and "f1_macro" in artifact
    assert [r.state.name for r in _task_runs(flow_run_id, expected=4)["generate"]] == ["Completed"]

    again = pipeline_flow.pipeline(root=str(root), return_state=True)
    assert [r.state.name for r in _task_runs(again.state_details.flow_run_id, expected=4)["generate"]] == ["Cached"]

    import shutil

    shutil.rmtree(root / "data/prepared")  # a cache hit must not skip rebuilding missing data
    rebuilt = pipeline_flow.pipeline(root=str(root), return_state=True)
    assert [r.state.name for r in _task_runs(rebuilt.state_details.flow_run_id, expected=4)["generate"]] == [
        "Completed"
    ]
    assert (root / "data/prepared/dataset.json").is_file()

    changed = pipeline_flow.pipeline(root=str(root), overrides={"data.seed": 7}, return_state=True)
    assert [r.state.name for r in _task_runs(changed.state_details.flow_run_id, expected=4)["generate"]] == [
        "Completed"
    ]


def test_config_error_fails_once_without_retry_and_leaves_data_intact(root: Path) -> None:
    pipeline_flow.pipeline(root=str(root))
    before = (root / "data/prepared/x_train.npy").read_bytes()
    state = pipeline_flow.pipeline(root=str(root), overrides={"train.batch_size": 4096}, return_state=True)
    assert state.is_failed()
    train_runs = _task_runs(state.state_details.flow_run_id, expected=2)["train"]
    assert len(train_runs) == 1 and train_runs[0].run_count == 1 and train_runs[0].state.name == "Failed"
    assert "larger than the train split" in str(train_runs[0].state.message)
    bad_csv = pipeline_flow.pipeline(
        root=str(root), overrides={"data.source": "csv", "data.csv_path": "nope.csv"}, return_state=True
    )
    assert bad_csv.is_failed()
    assert (root / "data/prepared/x_train.npy").read_bytes() == before
    assert not list((root / "data").glob(".prepared*"))  # no temporaries left


def test_unreachable_tracking_server_is_retried_then_fails(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    state = pipeline_flow.pipeline(root=str(root), return_state=True)
    assert state.is_failed()
    train = _task_runs(state.state_details.flow_run_id, expected=2)["train"][0]
    assert train.run_count == 3  # first try + 2 retries
    assert "unreachable" in str(train.state.message)


def test_flow_and_dvc_repro_give_the_same_metrics(repo_copy: Path) -> None:
    run(["dvc", "repro", "evaluate", "export"], repo_copy)
    from_dvc = json.loads((repo_copy / "reports/metrics.json").read_text())
    (repo_copy / "reports/metrics.json").unlink()
    pipeline_flow.pipeline(root=str(repo_copy))
    assert json.loads((repo_copy / "reports/metrics.json").read_text()) == from_dvc


def test_sweep_flow_runs_one_task_per_experiment_then_none_on_rerun(root: Path) -> None:
    state = sweep_flow.batch_size_sweep(root=str(root), overrides={"sweep.parallel": 2}, return_state=True)
    assert state.is_completed()
    tasks = _task_runs(state.state_details.flow_run_id, expected=5)
    # one task per measurement the sweep makes: the clock first, each experiment, each one's truth
    names = [r.name for r in sorted(tasks["experiment"], key=lambda r: r.expected_start_time)]
    experiments = ["bs16-seed0", "bs32-seed0", "bs64-seed0"]
    assert names[0] == "clock" and sorted(n for n in names if n.startswith("bs")) == experiments
    assert set(names[4:]) <= {f"truth-{e}" for e in experiments} and len(names) == 4 + len(set(names[4:]))
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("batchlab").experiment_id])
    parent = [r for r in runs if r.data.tags.get("sweep") == "parent"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id]
    assert len(parent) == 1 and len(children) == 3
    assert "## Verdict" in _artifact("batchlab-sweep") and "Recommended: batch" in _artifact("batchlab-sweep")
    assert (root / "reports/sweep/summary.md").is_file()

    reports = {p.name: p.read_bytes() for p in (root / "reports/sweep").iterdir()}
    again = sweep_flow.batch_size_sweep(root=str(root), overrides={"sweep.parallel": 2}, return_state=True)
    assert again.is_completed()
    assert "experiment" not in _task_runs(again.state_details.flow_run_id, expected=1)
    assert len(client.search_runs([runs[0].info.experiment_id])) == len(runs)
    assert {p.name: p.read_bytes() for p in (root / "reports/sweep").iterdir()} == reports
    assert parent[0].info.run_id in _artifact("batchlab-sweep")


def test_sweep_flow_refuses_while_another_sweep_holds_the_folder(root: Path) -> None:
    with lock.exclusive(Paths(root)):  # the lock `batchlab sweep` holds while it runs
        state = sweep_flow.batch_size_sweep(root=str(root), return_state=True)
    assert state.is_failed()
    assert "another sweep is running in this folder" in str(state.message)
    assert sorted(p.name for p in root.iterdir()) == [".batchlab", "params.yaml"]
    assert [p.name for p in (root / ".batchlab").iterdir()] == ["sweep.lock"]
