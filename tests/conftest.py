"""Fixtures and hooks; the helpers they use live in tests/support (one module), the tiers in
tests/support/tiers.py."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchlab.data import Dataset, build
from tests.support import (
    copy_repo,
    tiny_config,
)

pytest_plugins = ["tests.support.tiers", "pytester"]  # the tiers, their guard, order and summary; test_tiers


def pytest_configure(config: pytest.Config) -> None:
    """A pytest-xdist worker runs its own torch operations on its share of the cores, as
    threads.threads_per_process gives concurrent processes: with torch's default (every core) in
    each of N workers, a test's tiny in-process ops waited on threads of a team that the other
    workers had descheduled (test_gns_exact's dropout cases 0.5 s alone, 2.5-12 s beside another)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if workers.isdigit() and int(workers) > 1:
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(workers)))
    # matplotlib builds its font cache on its first use on a machine, running fc-list: here, before
    # any test, rather than in whichever unit test draws first (the tiers' guard failed it on a
    # fresh machine: "a unit test started 2 process(es) (fc-list --help; ...)")
    from matplotlib import font_manager

    font_manager.findfont("DejaVu Sans")


@pytest.fixture(scope="session")
def tiny_dataset() -> Dataset:
    return build(tiny_config().data)[0]


@pytest.fixture(autouse=True)
def _mlflow_uri_stays_the_users() -> Iterator[None]:
    """Each test leaves MLflow's tracking URI as it found it: mlflow.set_tracking_uri also exports
    MLFLOW_TRACKING_URI (so subprocesses inherit it), and a test that set it in this process sent
    every later test's runs, and their child processes, to its server, long since stopped (CI:
    test_tracking's SQLite writers all reached for test_team_load's http://127.0.0.1:...)."""
    before = {name: os.environ.get(name) for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID")}
    yield
    if "mlflow" in sys.modules:
        import mlflow
        from mlflow.tracking._tracking_service import utils

        if getattr(utils, "_tracking_uri", None) != before["MLFLOW_TRACKING_URI"]:
            mlflow.set_tracking_uri(before["MLFLOW_TRACKING_URI"])  # sets or unsets the variable too
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory, with no tracking URI inherited from the environment."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    return tmp_path


@pytest.fixture
def repo_copy(tmp_path: Path) -> Path:
    """The repo's tracked files in a fresh git + DVC repo, with tiny params."""
    return copy_repo(tmp_path / "repo")
