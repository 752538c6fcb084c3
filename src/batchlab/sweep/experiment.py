"""One batch-size experiment, run: found finished already, or trained and recorded.

An experiment is one MLflow child run under the sweep's parent run and one folder
(sweep/experiments/<name>/) with its model, history and result.json. The run stores the result row
before it ends FINISHED, so a finished experiment is never trained twice: not on a resume, not
when Dask runs its task again. Its plan and identity (config, key, folder, tags): plan.py.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from batchlab import atomic, data, kept, tracking
from batchlab.config import Config
from batchlab.sweep import probes, scoring, truth
from batchlab.sweep.plan import KEY_TAG, Experiment, Keyed, experiment_tags, keyed
from batchlab.sweep.tasks import Lane, Work
from batchlab.tracking import children
from batchlab.training import threads, tracked
from batchlab.training.throughput import Table
from batchlab.training.tracked import Trained

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Stopwatch:
    """An experiment's wall time: since `started` (perf_counter), plus `share`, its part of the time
    its group trained together (what is not train_seconds is overhead)."""

    started: float
    share: float = 0.0

    def seconds(self) -> float:
        return self.share + time.perf_counter() - self.started


def stored_result(lane: Lane, exp: Experiment, key: str) -> dict[str, Any] | None:
    """The result of an experiment that finished already: its result.json, else the row its FINISHED
    child run stored (its worker died after finishing, before the sweep collected it; or it ran in
    another worker's folder). None when it is still to train; then its unfinished attempts, wherever
    they ran, are ended KILLED, so that exactly one FINISHED run will hold it. `key`: its fingerprint."""
    path = lane.folder(exp).outputs / "result.json"
    found = read_result(path, key)
    if found is not None:
        return found
    run = lane.cfg.tracking, lane.parent_run_id
    found = children.finished_or_superseded(*run, KEY_TAG, key, scoring.RESULT_ARTIFACT)
    if found is None or found.get("fingerprint") != key:
        return None
    log.info("sweep: %s finished already (run %s): not training it again", exp.name, found.get("run_id"))
    atomic.write_json(path, found)
    return found


def train_and_score(lane: Lane, exp: Experiment) -> dict[str, Any]:
    """Train and test one experiment in its own folder, unless it finished already; returns its
    result row."""
    clock = Stopwatch(time.perf_counter())
    dataset = data.load(lane.paths.data)
    job = keyed(lane.cfg, exp, dataset.content_hash())
    done = stored_result(lane, exp, job.key)
    if done is not None:
        return done
    return train_one(lane, job, dataset, clock)


def train_one(lane: Lane, job: Keyed, dataset: data.Dataset, clock: Stopwatch) -> dict[str, Any]:
    """Train and record one experiment known to be still to train (`stored_result` found nothing)."""
    folder = lane.folder(job.exp)
    tracked.check_trainable(job.cfg, dataset)

    def train(tracker: tracking.Tracker) -> Trained:
        return tracked.train_in_run(job.cfg, folder, dataset, tracker)

    return record(lane, job, dataset, train, clock)


def record(
    lane: Lane,
    job: Keyed,
    dataset: data.Dataset,
    train: Callable[[tracking.Tracker], Trained],
    clock: Stopwatch,
    tags: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One experiment's child run, trained into by `train`, then measured and scored in the run
    while it is open, checked fully recorded once it has ended, and kept: every experiment's tail,
    trained alone or with its seeds. Returns its result row."""
    exp = job.exp
    tags = {**lane.tags, **experiment_tags(exp, job.key), **(tags or {})}
    run = tracked.train_run(job.cfg, lane.folder(exp), dataset, lane.parent_run_id, f"sweep-{exp.name}", tags)
    with run as tracker:
        trained = train(tracker)
        measured = measure(job.cfg, dataset, trained.history, lane.clock)
        result = scoring.score(exp, job.key, trained, dataset, measured, clock.seconds(), tracker, lane.clock)
    fully_recorded(exp, tracker)
    return keep(lane, exp, result)


def keep(lane: Lane, exp: Experiment, result: dict[str, Any]) -> dict[str, Any]:
    """Write a scored experiment's result.json, once its run has ended FINISHED, and keep the
    weights of only the val points a target can fall on (truth.trim); returns the row."""
    folder = lane.folder(exp)
    truth.trim(folder, result["curve_val_loss"], lane.cfg.sweep.target_val_loss)
    atomic.write_json(folder.outputs / "result.json", result)
    return result


def fully_recorded(exp: Experiment, tracker: tracking.Tracker) -> None:
    """An experiment counts once its child run holds all of it (its end, model and result row): one
    whose run the tracking backend stayed away from keeps no result.json and fails as transient
    (TrackingUnavailable), so its Prefect task is tried again; that try ends the unfinished run
    KILLED (stored_result) and trains the experiment anew. Without this the sweep finished with a
    RUNNING child that held no model and no result, and a rerun took its result.json for done."""
    missing = tracker.unrecorded()
    if missing:
        raise tracking.TrackingUnavailable(
            f"sweep: {exp.name}: the tracking backend stayed unreachable and run {tracker.run_id} lacks "
            f"{'; '.join(missing)}; the experiment runs again (run the sweep again if this one stops)"
        )


def measure(
    exp_cfg: Config, dataset: data.Dataset, history: list[dict[str, float]], clock: Table | None
) -> dict[str, float]:
    """The experiment's speed and step memory. The speed is the sweep's throughput table's at its
    batch size (`clock`, measured side by side: a seed's share of its group's time would flatter
    small batches, and one measurement per batch size, taken while its experiments ran, inverted
    under load), else its own epochs' medians (DDP/FSDP). The step memory, with and without the
    noise probe, is measured once per batch size (probes.step_memory)."""
    if clock is not None:
        per_s = clock.samples_per_s(exp_cfg.train.batch_size)
        speed = {"samples_per_s": per_s, "epoch_seconds": dataset.train.y.shape[0] / per_s}
    else:
        speed = {k: statistics.median(h[k] for h in history) for k in ("samples_per_s", "epoch_seconds")}
    return {**speed, **probes.step_memory(exp_cfg, dataset.input_shape, dataset.n_classes, dataset.vocab)}


def read_result(path: Path, expected: str) -> dict[str, Any] | None:
    """The result.json at `path` when it is the result of the experiment keyed `expected`."""
    return kept.read(path, expected, field="fingerprint")


def with_sweep_threads(run: Callable[[Lane, Work], R], lane: Lane, work: Work) -> R:
    """`run(lane, work)` on the sweep's torch threads: what a fresh process of a parallel sweep runs
    (threads.in_fresh_process), for one experiment or a group of them."""
    threads.use_threads(threads.sweep_threads(lane.cfg, data.shape(lane.paths.data)))
    return run(lane, work)
