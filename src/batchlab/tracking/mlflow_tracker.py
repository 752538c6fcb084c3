"""The MLflow tracker: logs into one run, by id, so several stages (processes) share a run."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from batchlab.config import TrackingConfig
from batchlab.tracking import children, outage, views
from batchlab.tracking.backend import quiet_mlflow, reachable, retry_locked
from batchlab.tracking.base import RESUMED, Tracker
from batchlab.tracking.flavors import logging_into, torch_flavor

if TYPE_CHECKING:
    from torch import nn

    from batchlab.data import Dataset

log = logging.getLogger(__name__)

WRITE_INTERVAL_S = 1.0


def metrics_from_rows(rows: list[dict[str, Any]]) -> list[Any]:
    from mlflow.entities import Metric

    return [Metric(m["key"], float(m["value"]), int(m["timestamp"]), int(m["step"])) for m in rows]


def log_metrics_batched(client: Any, run_id: str, metrics: list[Any]) -> None:
    for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
        retry_locked(client.log_batch, run_id, metrics=metrics[i : i + 1000])


class MlflowTracker(Tracker):
    """Logs into one MLflow run, by id, so several stages (processes) share a run.

    A backend that goes away mid-run costs no training: epoch metrics wait in memory for a later
    flush, and the end of the run waits outage.FINAL_WAIT_S at most, then keeps the metrics left in a
    file and names what was not recorded in one warning.
    """

    run_id: str  # always a run: the base's None means "no run"

    def __init__(self, run_id: str, cfg: TrackingConfig, uri: str | None = None) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        self.run_id = run_id
        self.cfg = cfg
        self.uri = uri or mlflow.get_tracking_uri()
        self.client = MlflowClient(self.uri)
        self._pending: list[Any] = []  # epoch metrics not yet written
        self._last_write = time.monotonic()
        self._recorded: dict[str, int] = {}  # a continued run: the last step each metric has already
        self._backend = outage.Backend(self.uri, probe=lambda: reachable(self.uri))
        self._not_recorded: list[str] = []
        self._replayed = False

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        batch = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(batch), 100):  # log_batch(run_id, metrics, params): through an outage
            part = batch[i : i + 100]
            self._persist(f"{len(part)} params", self.client.log_batch, self.run_id, [], part)

    def log_epoch(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._pending += [
            Metric(k, float(v), now, step)
            for k, v in metrics.items()
            if k != "epoch" and step > self._recorded.get(k, -1)
        ]
        # one write per epoch, but at most one per second: a SQLite write costs ~7 ms, which is
        # 20% of a 30 ms epoch (an async write costs as much, through the GIL)
        if time.monotonic() - self._last_write >= WRITE_INTERVAL_S:
            self.flush()

    def flush(self) -> None:
        """Write the epoch metrics not yet written; while the backend is unreachable keep them for later."""
        if self._pending and self._backend.answers():
            try:
                self._write_pending()
            except Exception as err:
                if not outage.unreachable(err):
                    raise
                self._backend.went_down(err)
        self._last_write = time.monotonic()

    def _write_pending(self) -> None:
        while self._pending:  # drop each batch once written: a failure leaves only the rest pending
            batch = self._pending[:1000]  # MLflow takes at most 1000 metrics per batch
            retry_locked(self.client.log_batch, self.run_id, metrics=batch)
            del self._pending[: len(batch)]
        if self._replayed:  # what an earlier command left is recorded now
            outage.unrecorded_path(self.run_id).unlink(missing_ok=True)
            self._replayed = False
        self._backend.came_back()

    def _persist(self, what: str, call: Callable[..., Any], *args: Any) -> Any:
        """A write that waits through an outage (outage.Backend.persist: FINAL_WAIT_S in all over the
        run's writes); when the backend stays away, `what` is named as not recorded."""
        recorded, result = self._backend.persist(lambda: retry_locked(call, *args))
        if not recorded:
            self._not_recorded.append(what)
        return result

    def log_metrics(self, metrics: Mapping[str, float]) -> None:
        self.log_epoch(metrics, step=0)
        self.flush()

    def set_tags(self, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        listed = [RunTag(k, str(v)) for k, v in tags.items()]  # log_batch(run_id, metrics, params, tags)
        self._persist(f"tags {', '.join(tags)}", self.client.log_batch, self.run_id, [], [], listed)

    def log_artifact(self, path: str | Path, folder: str | None = None) -> None:
        self._persist(Path(path).name, self.client.log_artifact, self.run_id, str(path), folder)

    def log_table(self, rows: list[dict[str, Any]], artifact_file: str) -> None:
        """Rows as an MLflow table: the run's Artifacts tab shows it, mlflow.load_table reads it back."""
        columns = {key: [row.get(key) for row in rows] for key in rows[0]} if rows else {}
        self._persist(artifact_file, self.client.log_table, self.run_id, columns, artifact_file)

    def log_dict(self, values: Mapping[str, Any], artifact_file: str) -> None:
        """A JSON artifact (what tracking.children.finished_or_superseded reads back)."""
        self._persist(artifact_file, self.client.log_dict, self.run_id, dict(values), artifact_file)

    def log_datasets(self, dataset: Dataset, source: str) -> None:
        from mlflow.data.numpy_dataset import from_numpy
        from mlflow.entities import DatasetInput, InputTag

        digest = dataset.content_hash()
        inputs = []
        for context in ("train", "val", "test"):
            split = getattr(dataset, context)
            ds = from_numpy(split.x, targets=split.y, name=f"{source}-{context}", digest=digest)
            inputs.append(DatasetInput(ds._to_mlflow_entity(), [InputTag("mlflow.data.context", context)]))
        retry_locked(self.client.log_inputs, self.run_id, datasets=inputs)

    def _pip_requirements(self) -> list[str]:
        # explicit requirements: inferring them cost 9-15 s per model on these machines
        import mlflow
        import torch

        return [f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}", "numpy"]

    def log_torch_model(self, model: nn.Module, example: np.ndarray) -> str | None:
        import torch
        from mlflow.models import infer_signature

        with torch.no_grad():
            output = model.cpu()(torch.from_numpy(example)).numpy()

        def log_model() -> str:
            with logging_into(self.run_id):
                info = torch_flavor().log_model(
                    model,
                    name="torch_model",  # scaled float32 in, logits out; the registry serves `predictor`
                    signature=infer_signature(example, output),
                    input_example=example[:5],
                    pip_requirements=self._pip_requirements(),
                )
            return str(info.model_uri)

        uri: str | None = self._persist("the model", log_model)
        return uri

    def log_onnx_model(self, path: str | Path) -> None:
        import mlflow
        import onnx

        from batchlab.tracking.pyfunc import onnx_signature

        def log_model() -> None:
            with logging_into(self.run_id):
                mlflow.onnx.log_model(onnx.load(str(path)), name="onnx_model", signature=onnx_signature(Path(path)),
                                      pip_requirements=["onnxruntime", "numpy"])

        self._persist("the ONNX model", log_model)

    def log_predictor(self, onnx_path: str | Path, example_rows: np.ndarray) -> str | None:
        from batchlab.tracking import pyfunc

        uri: str | None = self._persist(
            "the predictor model", pyfunc.log_predictor, self.run_id, Path(onnx_path), example_rows
        )
        return uri

    def record_digests(self) -> None:
        from batchlab.tracking import digests

        self._persist("the model digests", digests.record, self.client, self.run_id, self.uri)

    def register(self, model_uri: str, score: float, metric: str) -> bool:
        """Register the predictor; move the champion alias only when `score` beats the champion's."""
        if not self.cfg.registered_model:
            return False
        return bool(self._persist(f"the registration of {model_uri}", self._register, model_uri, score, metric))

    def _register(self, model_uri: str, score: float, metric: str) -> bool:
        from batchlab.tracking import registry
        from batchlab.tracking.pyfunc import REGISTRY_DESCRIPTION, version_description

        name = self.cfg.registered_model
        quiet_mlflow()  # logging a model before (the predictor) switches mlflow's news back on
        tags = {metric: f"{score:.6f}", "run_id": self.run_id}
        version, champion = registry.register(self.client, name, model_uri, tags, metric)
        retry_locked(self.client.update_model_version, name, version, version_description(self.run_id))
        if not retry_locked(self.client.get_registered_model, name).description:
            retry_locked(self.client.update_registered_model, name, REGISTRY_DESCRIPTION)
        return champion

    def log_on_children(self, figures: dict[str, dict[str, float]]) -> None:
        self._persist("the children's study figures", children.log_on_children, self.client, figures)

    def end_duplicates(self, tag: str, keep: set[str]) -> None:
        self._persist("the end of duplicate child runs", children.end_duplicates, self.client, self.run_id, tag, keep)

    def save_view(self, name: str, batch_param: str, batch_tag: str) -> str | None:
        link: str | None = self._persist("the sweep's MLflow view", views.save, self.client, self.run_id, name,
                                         batch_param, batch_tag)
        return link

    def replay_unrecorded(self) -> None:
        """Queue the metrics an earlier command could not record in this run (sent with the next flush)."""
        metrics = metrics_from_rows(outage.load_unrecorded(self.run_id)[0])
        if metrics:
            log.info("tracking: recording %d metric values an earlier command could not", len(metrics))
            self._pending = metrics + self._pending
            self._replayed = True
            self.flush()

    def skip_recorded_epochs(self) -> None:
        """Epoch steps this run already holds are not written again (a resumed training replays them)."""
        run = retry_locked(self.client.get_run, self.run_id)
        for key in run.data.metrics:
            history = retry_locked(self.client.get_metric_history, self.run_id, key)
            self._recorded[key] = max((m.step for m in history), default=-1)
        for m in self._pending:  # queued by replay_unrecorded, not written yet
            self._recorded[m.key] = max(self._recorded.get(m.key, -1), m.step)

    def continue_epochs(self, epochs: list[dict[str, float]]) -> None:
        """A resumed training: record the epochs of its checkpoint that the killed process had not
        written yet; the steps the run holds are not written twice."""
        self.skip_recorded_epochs()
        for row in epochs:
            self.log_epoch(row, step=int(row["epoch"]))
        self.flush()
        self.set_tags({RESUMED: str(len(epochs))})

    def end(self, status: str) -> None:
        """Write what is pending and end the run with `status`; what the backend would not take is
        named in one warning, and the metrics among it are kept in outage.UNRECORDED_DIR."""
        import mlflow

        if self._pending:
            self._backend.persist(self._write_pending)

        def terminate() -> None:
            active = mlflow.active_run()
            if active is not None and active.info.run_id == self.run_id:
                mlflow.end_run(status)  # takes it off the active-run stack first, then tells the backend
            else:
                self.client.set_terminated(self.run_id, status)

        if not self._backend.persist(terminate)[0]:
            self._not_recorded.append(f"the end of the run ({status})")
            active = mlflow.active_run()
            if active is not None and active.info.run_id == self.run_id:
                with contextlib.suppress(Exception):  # off the active-run stack; the backend will not answer
                    mlflow.end_run(status)
        if self._pending or self._not_recorded:
            self._warn_unrecorded(status)

    def unrecorded(self) -> list[str]:
        return [*self._not_recorded, *([f"{len(self._pending)} metric values"] if self._pending else [])]

    def _warn_unrecorded(self, status: str) -> None:
        lost = list(self._not_recorded)
        if self._pending:
            rows = [{"key": m.key, "value": m.value, "timestamp": m.timestamp, "step": m.step} for m in self._pending]
            path = outage.save_unrecorded(self.run_id, self.uri, status, rows, lost)
            lost.insert(0, f"{len(rows)} metric values (kept in {path}; the next command opening the run sends them)")
        log.warning(
            "batchlab: warning: tracking backend %s was unreachable; not recorded in run %s: %s",
            self.uri, self.run_id, "; ".join(lost),
        )
