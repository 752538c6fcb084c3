"""One batch-size experiment: the same model, data, initial weights and epochs at every batch size.

An experiment is one MLflow child run under the sweep's parent run and one folder
(sweep/experiments/<name>/) with its model, history and result.json. Its key (`fingerprint`:
params, data and code) tags the run, and the run stores the result row before it ends FINISHED,
so a finished experiment is never trained twice: not on a resume, not when Dask runs its task again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from batchlab import atomic, data, stages, tracking
from batchlab.config import Config, parse_config
from batchlab.seeds.vectorized import trains_together
from batchlab.sweep import probes, scoring, truth
from batchlab.tracking import children
from batchlab.training import threads
from batchlab.training.optim import scaled_lr, steps_per_epoch
from batchlab.validate import batches_fit

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Experiment:
    batch_size: int
    seed: int
    lr: float
    epochs: int
    lr_multiplier: float = 1.0
    eval_every_steps: int = 0  # score the val split this often: the step that reaches the target
    curve_weights: bool = False  # keep the weights there: the exact noise scale at the target (truth.py)
    # probe the noise scale once an epoch: the study reads it at the target, which the cost model's
    # period (up to 556 steps) passes in most experiments; it costs ~6 s of the default study's training
    gns_every: int | None = None
    # sweep.adaptive: train.adaptive_batch from batch_size (the smallest) to max_batch_size (the largest)
    adaptive: bool = False
    max_batch_size: int | None = None

    @property
    def name(self) -> str:
        lr = "" if self.lr_multiplier == 1.0 else f"-lrx{self.lr_multiplier:g}"
        return f"{'adaptive' if self.adaptive else f'bs{self.batch_size}'}{lr}-seed{self.seed}"


def plan(cfg: Config, n_train: int, dataset: data.Dataset | None = None) -> list[Experiment]:
    """Every (batch size, lr multiplier, seed); rejects a batch the train split cannot fill before anything runs."""
    batches_fit(cfg, n_train)
    sc = cfg.sweep
    epochs = sc.epochs or cfg.train.epochs
    return [
        Experiment(
            b,
            seed,
            m * scaled_lr(cfg.train.lr, cfg.train.batch_size, b, sc.lr_scaling),
            epochs,
            m,
            max(1, steps_per_epoch(n_train, b) // sc.evals_per_epoch),
            n_train <= sc.exact_noise_rows,
            probe_every(steps_per_epoch(n_train, b), max(1, steps_per_epoch(n_train, b) // sc.evals_per_epoch)),
        )
        for b in sc.batch_sizes
        for m in sc.lr_multipliers
        for seed in sc.seeds
    ] + (adaptive_plan(cfg, n_train, dataset) if sc.adaptive else [])


def probe_every(epoch_steps: int, eval_every: int) -> int:
    """The noise probe's period: about an epoch, a multiple of the val points' period, so each
    reading measures the weights of a val point (gns_probes.FullSplitProbe), which the exact value
    at the reading is taken at (truth.py)."""
    return eval_every * max(1, epoch_steps // eval_every)


def adaptive_plan(cfg: Config, n_train: int, dataset: data.Dataset | None = None) -> list[Experiment]:
    """sweep.adaptive's experiments, one per seed: from the smallest batch size (at its scaled lr)
    up to the largest (with sweep.memory_budget_mb, the largest whose measured step memory fits:
    the study's own probe, `dataset` given), scored as often as the largest batch's experiments are
    (its steps grow)."""
    sc = cfg.sweep
    low, high = min(sc.batch_sizes), max(sc.batch_sizes)
    if sc.memory_budget_mb is not None and dataset is not None:
        shape = (dataset.input_shape, dataset.n_classes, dataset.vocab)
        fits = [b for b in sorted(sc.batch_sizes) if _step_mib(cfg, b, n_train, shape) <= sc.memory_budget_mb]
        high = max(fits, default=low)
    lr = scaled_lr(cfg.train.lr, cfg.train.batch_size, low, sc.lr_scaling)
    every = max(1, steps_per_epoch(n_train, high) // sc.evals_per_epoch)
    epochs = sc.epochs or cfg.train.epochs
    return [Experiment(low, seed, lr, epochs, eval_every_steps=every, adaptive=True, max_batch_size=high)
            for seed in sc.seeds]  # fmt: skip


def _step_mib(cfg: Config, batch: int, n_train: int, shape: tuple[tuple[int, ...], int, int]) -> float:
    """The step memory the study reports for `batch` (probes.step_memory, measured once per batch)."""
    lr = scaled_lr(cfg.train.lr, cfg.train.batch_size, batch, cfg.sweep.lr_scaling)
    exp = Experiment(batch, 0, lr, 1, gns_every=steps_per_epoch(n_train, batch))
    return probes.step_memory(experiment_config(cfg, exp), *shape)["step_memory_mib"]


def experiment_config(cfg: Config, exp: Experiment) -> Config:
    raw = cfg.model_dump()
    # identical conditions: the same epochs for everyone, so no early stopping
    raw["train"].update(batch_size=exp.batch_size, lr=exp.lr, seed=exp.seed, epochs=exp.epochs)
    raw["train"].update(
        early_stopping_patience=0,
        eval_every_steps=exp.eval_every_steps,
        curve_weights=exp.curve_weights,
        gns_every=exp.gns_every,
    )
    if exp.adaptive:  # its probe follows train.adapt_every_steps, its lr the sweep's rule
        rule = cfg.sweep.lr_scaling
        raw["train"].update(adaptive_batch=True, max_batch_size=exp.max_batch_size, adapt_lr_scaling=rule)
    return parse_config(raw)


def _tree_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for source in sorted(folder.rglob("*.py")) if folder.is_dir() else []:
        digest.update(source.relative_to(folder).as_posix().encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:12]


@functools.cache
def code_hash() -> str:
    """The package's source: a result measured by other code is not this code's result (a resume
    after an edit re-measures, as `dvc repro` expects when it reruns the stage for the edit)."""
    return _tree_hash(Path(__file__).parents[1])  # batchlab/, every subpackage included


def fingerprint(cfg: Config, exp: Experiment, data_hash: str) -> str:
    """An experiment's key: its params, the data and the code that measured it."""
    return key_of(experiment_config(cfg, exp), data_hash)


def key_of(exp_cfg: Config, data_hash: str) -> str:
    """model.factory's experiments also key on usermodels/ (its code, at the project root): an edit
    there re-measures them. The built-in models' keys stay as they were."""
    user = f"-{_tree_hash(Path.cwd() / 'usermodels')}" if exp_cfg.model.factory else ""
    return f"{exp_cfg.section_hash('model', 'train')}-{data_hash}-{code_hash()}{user}"


def experiment_paths(paths: stages.Paths, exp: Experiment) -> stages.Paths:
    """The experiment's own folder for models/, reports/, its checkpoint and result.json."""
    return stages.Paths(root=paths.root, out=paths.outputs / "sweep" / "experiments" / exp.name)


# the experiment's fingerprint on its child run (its result row: scoring.RESULT_ARTIFACT)
KEY_TAG = "sweep.key"
RESULT_ARTIFACT = scoring.RESULT_ARTIFACT


def experiment_tags(exp: Experiment, key: str) -> dict[str, str]:
    return {
        "sweep.batch_size": str(exp.batch_size),
        "sweep.seed": str(exp.seed),
        "sweep.lr_multiplier": f"{exp.lr_multiplier:g}",
        **({"sweep.adaptive": "true"} if exp.adaptive else {}),
        KEY_TAG: key,
    }


def stored_result(
    cfg: Config, exp: Experiment, paths: stages.Paths, parent_run_id: str | None, key: str
) -> dict[str, Any] | None:
    """The result of an experiment that finished already: its result.json, else the row its FINISHED
    child run stored (its worker died after finishing, before the sweep collected it; or it ran in
    another worker's folder). None when it is still to train; then its unfinished attempts, wherever
    they ran, are ended KILLED, so that exactly one FINISHED run will hold it. `key`: its fingerprint."""
    path = experiment_paths(paths, exp).outputs / "result.json"
    found = read_result(path, key)
    if found is not None:
        return found
    found = children.finished_or_superseded(cfg.tracking, parent_run_id, KEY_TAG, key, RESULT_ARTIFACT)
    if found is None or found.get("fingerprint") != key:
        return None
    log.info("sweep: %s finished already (run %s): not training it again", exp.name, found.get("run_id"))
    atomic.write_json(path, found)
    return found


def keep(cfg: Config, paths: stages.Paths, exp: Experiment, result: dict[str, Any]) -> dict[str, Any]:
    """Write a scored experiment's result.json, once its run has ended FINISHED, and keep the
    weights of only the val points a target can fall on (truth.trim); returns the row."""
    folder = experiment_paths(paths, exp)
    truth.trim(folder, result["curve_val_loss"], cfg.sweep.target_val_loss)
    atomic.write_json(folder.outputs / "result.json", result)
    return result


def train_and_score(cfg: Config, exp: Experiment, paths: stages.Paths, parent_run_id: str | None) -> dict[str, Any]:
    """Train and test one experiment in its own folder, unless it finished already; returns its result row."""
    started = time.perf_counter()
    dataset = data.load(paths.data)
    exp_cfg = experiment_config(cfg, exp)  # built once: the run's params, the key, the probes
    key = key_of(exp_cfg, dataset.content_hash())
    done = stored_result(cfg, exp, paths, parent_run_id, key)
    if done is not None:
        return done
    return train_one(cfg, exp, exp_cfg, key, paths, parent_run_id, dataset, started)


def train_one(
    cfg: Config,
    exp: Experiment,
    exp_cfg: Config,
    key: str,
    paths: stages.Paths,
    parent_run_id: str | None,
    dataset: data.Dataset,
    started: float,
) -> dict[str, Any]:
    """Train and test one experiment known to be still to train (`stored_result` found nothing);
    `started`: when its task began (perf_counter), for its overhead."""
    tags = experiment_tags(exp, key)
    folder = experiment_paths(paths, exp)
    with stages.training(exp_cfg, folder, dataset, parent_run_id, f"sweep-{exp.name}", tags) as (tracker, trained):
        measured = measure(cfg, exp_cfg, dataset, trained.history)
        result = scoring.score(exp, key, trained, dataset, measured, time.perf_counter() - started, tracker)
    fully_recorded(exp, tracker)
    return keep(cfg, paths, exp, result)


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


def measure(cfg: Config, exp_cfg: Config, dataset: data.Dataset, history: list[dict[str, float]]) -> dict[str, float]:
    """The experiment's speed and step memory. Its own epochs' medians (one epoch slowed by a busy
    machine should not move the comparison), or, when seeds train together, one training alone at
    its batch size and lr (probes.solo_speed: a seed's share of its group's time would flatter
    small batches). The step memory, with and without the noise probe, is measured once per batch
    size (probes.step_memory)."""
    if trains_together(cfg) and not exp_cfg.train.adaptive_batch:  # an adaptive run trains alone
        speed = probes.solo_speed(exp_cfg, dataset)
    else:
        speed = {k: statistics.median(h[k] for h in history) for k in ("samples_per_s", "epoch_seconds")}
    return {**speed, **probes.step_memory(exp_cfg, dataset.input_shape, dataset.n_classes, dataset.vocab)}


def read_result(path: Path, expected: str) -> dict[str, Any] | None:
    """The result.json at `path` when it is the result of the experiment keyed `expected`."""
    if not path.is_file():
        return None
    result: dict[str, Any] = json.loads(path.read_text())
    return result if result.get("fingerprint") == expected else None


def with_sweep_threads(run: Callable[[Config, T, stages.Paths, str | None], R], cfg: Config, work: T,
                       paths: stages.Paths, parent_run_id: str | None) -> R:  # fmt: skip
    """`run(cfg, work, ...)` on the sweep's torch threads: what a fresh process of a parallel sweep
    runs (threads.in_fresh_process), for one experiment or a group of them."""
    threads.use_threads(threads.sweep_threads(cfg, data.shape(paths.data)))
    return run(cfg, work, paths, parent_run_id)


def run_experiment(cfg: Config, exp: Experiment, paths: stages.Paths, parent_run_id: str | None) -> dict[str, Any]:
    """One experiment: in this process, or in a fresh one with its share of the cores when
    sweep.parallel experiments run at once."""
    if cfg.sweep.parallel == 1:
        return train_and_score(cfg, exp, paths, parent_run_id)
    cores = threads.threads_per_process(cfg.sweep.parallel)
    return threads.in_fresh_process(cores, with_sweep_threads, train_and_score, cfg, exp, paths, parent_run_id)
