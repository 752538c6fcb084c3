"""The champion alias when exports overlap: a real MLflow registry (a SQLite file), two exports on
threads whose reads and writes are put in the one order that used to leave the worse version
champion. The pacing wraps a real client; every read and write reaches the store."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import mlflow
import mlflow.pyfunc
import pytest
from mlflow import MlflowClient

from batchlab import tracking
from batchlab.tracking import registry

pytestmark = pytest.mark.integration  # MLflow stores written in this process (SQLite), or servers: e2e

NAME = "racers"


class _Constant(mlflow.pyfunc.PythonModel):
    def predict(self, context: Any, model_input: list[Any]) -> list[Any]:
        return model_input


class _Paced:
    """A real client that, before one chosen call, signals `reached` and waits for `go`."""

    def __init__(self, client: MlflowClient, method: str) -> None:
        self.client, self.method = client, method
        self.reached, self.go = threading.Event(), threading.Event()

    def __getattr__(self, attr: str) -> Any:
        real = getattr(self.client, attr)
        if attr != self.method or self.reached.is_set():
            return real

        def paced(*args: Any, **kwargs: Any) -> Any:
            self.reached.set()
            assert self.go.wait(60), f"{self.method} was never let through"
            return real(*args, **kwargs)

        return paced


def _registry_with_a_model(tmp_path: Path) -> tuple[str, MlflowClient, str]:
    """A SQLite store holding one logged model: its URI, a client, the model's URI to register."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    with mlflow.start_run(experiment_id=client.create_experiment("exports")) as made:
        mlflow.pyfunc.log_model(name="model", python_model=_Constant(), pip_requirements=[])
    return uri, client, f"runs:/{made.info.run_id}/model"


def _thread(client: Any, source: str, score: float, out: dict[float, tuple[str, bool]]) -> threading.Thread:
    def export() -> None:
        out[score] = registry.register(client, NAME, source, {"f1": f"{score:.2f}"}, "f1")

    thread = threading.Thread(target=export)
    thread.start()
    return thread


def test_an_export_that_starts_while_a_better_one_settles_leaves_the_better_one_champion(tmp_path: Path) -> None:
    """Champion v1 (0.90). A registers v2 (0.95) and is held before its first read of the alias. B
    starts, registers v3 (0.92), decides, and is held before writing the alias. A settles on v2
    and finishes; then B writes. Counting B's rivals from the highest number at its start (2), B
    decided v3 over v1 without seeing v2, wrote it last, read it back as settled: v3 stayed."""
    uri, client, source = _registry_with_a_model(tmp_path)
    assert registry.register(client, NAME, source, {"f1": "0.90"}, "f1") == ("1", True)

    a = _Paced(MlflowClient(uri), "get_model_version_by_alias")
    b = _Paced(MlflowClient(uri), "set_registered_model_alias")
    out: dict[float, tuple[str, bool]] = {}
    first = _thread(a, source, 0.95, out)
    assert a.reached.wait(60)  # v2 exists, A has read nothing of the alias yet
    second = _thread(b, source, 0.92, out)
    assert b.reached.wait(60)  # v3 exists and B has decided
    a.go.set()
    first.join(60)
    b.go.set()
    second.join(60)

    assert out == {0.95: ("2", True), 0.92: ("3", False)}
    champion = client.get_model_version_by_alias(NAME, tracking.CHAMPION)
    assert str(champion.version) == "2"
    # each export, done, takes its version out of those still settling
    assert all(registry.SETTLING not in v.tags for v in client.search_model_versions(f"name='{NAME}'"))


def test_a_champion_moved_back_by_hand_stays_until_a_newer_version_beats_it(tmp_path: Path) -> None:
    _, client, source = _registry_with_a_model(tmp_path)
    for score in (0.90, 0.95):
        registry.register(client, NAME, source, {"f1": f"{score:.2f}"}, "f1")
    client.set_registered_model_alias(NAME, tracking.CHAMPION, "1")  # a person's choice
    assert registry.register(client, NAME, source, {"f1": "0.80"}, "f1") == ("3", False)
    assert str(client.get_model_version_by_alias(NAME, tracking.CHAMPION).version) == "1"
    assert registry.register(client, NAME, source, {"f1": "0.93"}, "f1") == ("4", True)
