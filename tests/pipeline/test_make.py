"""The Makefile's own targets: help, compare, and the two servers (`make ui`, `make serve`), which
must be light, answer on the port asked for, and stop when make is stopped."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from tests.support import REPO, env_with_venv, free_port, run, wait_until

STAMP = ".batchlab-installed"  # the Makefile's $(STAMP) inside $(VENV)


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    """VENV= for make: this environment, linked entry by entry, with a fresh set-up stamp, so that
    `setup` has nothing to do (it would otherwise pip-install into the shared environment)."""
    folder = tmp_path / "venv"
    folder.mkdir()
    for entry in Path(sys.prefix).iterdir():
        if entry.name != STAMP:
            (folder / entry.name).symlink_to(entry)
    (folder / STAMP).touch()
    return folder


def _make(venv: Path, *args: str) -> list[str]:
    return ["make", "--no-print-directory", "-f", str(REPO / "Makefile"), f"VENV={venv}", *args]


@pytest.mark.integration
def test_make_help_is_the_default_and_lists_every_target_with_its_comment(venv: Path) -> None:
    shown = run(_make(venv), REPO).stdout
    phony = re.search(r"^\.PHONY:(.*)$", (REPO / "Makefile").read_text(), flags=re.M)
    assert phony is not None
    for target in phony.group(1).split():
        assert re.search(rf"^  make {target} +\S", shown, flags=re.M), f"`make help` misses {target}:\n{shown}"


@pytest.mark.integration
def test_make_compare_fits_a_terminal_and_shows_changed_params_and_headline_metrics(
    repo_copy: Path, venv: Path
) -> None:
    """The committed dvc.lock and metrics (HEAD) against a workspace with another learning rate
    whose every metric differs, as after `dvc exp run` (export's latencies and sizes, the study's
    figures and timings all change)."""
    params = yaml.safe_load((repo_copy / "params.yaml").read_text())
    params["train"]["lr"] = 0.5
    (repo_copy / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for metrics in ("reports/export.json", "reports/sweep/sweep.json", "reports/metrics.json"):
        path = repo_copy / metrics
        path.write_text(json.dumps(_moved(json.loads(path.read_text()))))
    shown = run(_make(venv, "compare"), repo_copy, COLUMNS="100").stdout
    for wanted in ("workspace", "train.lr", "0.5", "accuracy", "f1_macro", "roc_auc", "b_crit", "recommended_batch"):
        assert wanted in shown, f"{wanted!r} missing:\n{shown}"
    # unchanged params, per-class metrics, the deps' hash columns, export's latencies and the
    # study's other figures are left out, and the Created column (a commit older than today shows
    # a date there, four characters wider than today's time): nothing is cut, and it fits 100 columns
    unwanted = ("…", "Created", "train.epochs", "precision_0", "f1_weighted", "src/batchlab", "data/prepared",
                "latency", "file_bytes", "b_simple", "sweep_wall_seconds", "fit_r2")  # fmt: skip
    for column in unwanted:
        assert column not in shown, f"{column!r} shown:\n{shown}"
    assert max(len(line) for line in shown.splitlines()) <= 102, shown


def _moved(value: Any) -> Any:
    """Every number of a metrics file changed a little."""
    if isinstance(value, dict):
        return {k: _moved(v) for k, v in value.items()}
    return value * 1.01 + 1 if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _stop(make: subprocess.Popen[Any], port: int) -> list[psutil.Process]:
    """SIGTERM to make alone (what `kill <make's pid>` does); every process it started must exit,
    and the port must be free again. Returns the processes that were still running."""
    tree = [psutil.Process(make.pid), *psutil.Process(make.pid).children(recursive=True)]
    make.terminate()
    make.wait(timeout=60)
    _, alive = psutil.wait_procs(tree, timeout=60)
    for process in alive:  # do not leave them behind for the next test
        process.kill()
    wait_until(lambda: _port_is_free(port), f"port {port} to be free", timeout=30)
    return alive


@pytest.fixture
def stopped() -> Iterator[list[subprocess.Popen[Any]]]:
    """Servers a test started: killed with their children if the test failed half-way."""
    started: list[subprocess.Popen[Any]] = []
    yield started
    for make in started:
        if make.poll() is None:
            for process in [*psutil.Process(make.pid).children(recursive=True), psutil.Process(make.pid)]:
                process.kill()


@pytest.mark.integration
def test_make_ui_is_one_light_server_on_ui_port_opening_the_runs_table_and_stops_with_make(
    repo_copy: Path, venv: Path, tmp_path: Path, stopped: list[subprocess.Popen[Any]]
) -> None:
    from mlflow import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment = MlflowClient(store).create_experiment("batchlab")  # params.yaml's tracking.experiment
    port = free_port()
    log_path = tmp_path / "make-ui.log"
    with open(log_path, "w") as log:
        make = subprocess.Popen(
            _make(venv, "ui", f"UI_PORT={port}"),
            cwd=repo_copy,
            env=env_with_venv(MLFLOW_TRACKING_URI=store),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    stopped.append(make)
    health = f"http://127.0.0.1:{port}/health"
    wait_until(lambda: httpx.get(health, timeout=2).status_code == 200, "make ui", process=make, log=log_path)
    processes = [psutil.Process(make.pid), *psutil.Process(make.pid).children(recursive=True)]
    assert len(processes) <= 3, [" ".join(p.cmdline()) for p in processes]  # make, mlflow, uvicorn
    alive = _stop(make, port)
    assert not alive, f"still running after make stopped: {[p.pid for p in alive]}"

    output = log_path.read_text()
    assert f"http://127.0.0.1:{port}/#/experiments/{experiment}?workflowType=machine_learning" in output, output
    assert "Warning" not in output, output


@pytest.mark.integration
def test_make_serve_on_another_port_points_its_ui_there_and_serves_the_deployments(
    repo_copy: Path, venv: Path, tmp_path: Path, stopped: list[subprocess.Popen[Any]]
) -> None:
    port = free_port()
    env = env_with_venv(
        PREFECT_PORT=str(port),
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_UI_STATIC_DIRECTORY=str(tmp_path / "prefect-ui"),  # not into the shared site-packages
        BATCHLAB_TIMEZONE="Europe/Amsterdam",
    )
    for key in ("PREFECT_API_URL", "PREFECT_UI_API_URL"):
        env.pop(key, None)
    log_path = tmp_path / "make-serve.log"
    with open(log_path, "w") as log:
        make = subprocess.Popen(_make(venv, "serve"), cwd=repo_copy, env=env, stdout=log, stderr=subprocess.STDOUT)
    stopped.append(make)
    base = f"http://127.0.0.1:{port}"

    def ui_settings() -> dict[str, Any]:
        return dict(httpx.get(f"{base}/ui-settings", timeout=5).raise_for_status().json())

    # what the Prefect UI fetches to learn where its API is
    settings = wait_until(ui_settings, "the Prefect UI settings", process=make, log=log_path)
    assert settings["api_url"] == f"{base}/api", settings

    def deployment(name: str) -> dict[str, Any] | None:
        response = httpx.get(f"{base}/api/deployments/name/{name}", timeout=5)
        return dict(response.json()) if response.status_code == 200 else None

    descriptions = {
        name: wait_until(lambda name=name: deployment(name), name, interval=1, process=make, log=log_path)[
            "description"
        ]
        for name in ("batchlab-pipeline/nightly", "batchlab-sweep/weekly")
    }
    assert "nightly at 02:00 Europe/Amsterdam" in descriptions["batchlab-pipeline/nightly"], descriptions
    assert "Sunday at 03:00 Europe/Amsterdam" in descriptions["batchlab-sweep/weekly"], descriptions

    alive = _stop(make, port)
    assert not alive, f"still running after make stopped: {[p.pid for p in alive]}"
