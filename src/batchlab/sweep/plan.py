"""The sweep's plan: every experiment it trains, each one's identity (its config, key, folder and
tags), and the work items and lanes they run in.

An experiment is the same model, data, initial weights and epochs at one batch size, lr multiplier
and seed. Its key (`key_of`: params, data and code) tags its MLflow child run, so a finished
experiment is never trained twice: not on a resume, not when Dask runs its task again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

from batchlab import data
from batchlab.config import Config, ConfigError, TrainConfig, parse_config
from batchlab.paths import Paths
from batchlab.sweep import probes
from batchlab.training.optim import scaled_lr, steps_per_epoch
from batchlab.training.throughput import Table
from batchlab.validate import batches_fit


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
    # the time rule's step time (a, b, p): the sweep's throughput table's fit and probe (with_step_time)
    step_time: tuple[float, ...] | None = None
    # the schedule rule's (share, batch): the sweep's local CBS(t) (with_schedule)
    schedule: tuple[tuple[float, int], ...] | None = None

    @property
    def name(self) -> str:
        lr = "" if self.lr_multiplier == 1.0 else f"-lrx{self.lr_multiplier:g}"
        return f"{'adaptive' if self.adaptive else f'bs{self.batch_size}'}{lr}-seed{self.seed}"


def folder_of(paths: Paths, exp: Experiment) -> Paths:
    """The experiment's own folder for models/, reports/, its checkpoint and result.json."""
    return folder_named(paths, exp.name)


def folder_named(paths: Paths, name: str) -> Paths:
    """The folder of the experiment named `name` (Experiment.name)."""
    return Paths(root=paths.root, out=paths.outputs / "sweep" / "experiments" / name)


@dataclass(frozen=True)
class Keyed:
    """An experiment with its config and key, each built once: the run's params, the key, the probes."""

    exp: Experiment
    cfg: Config
    key: str


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
        fits = [b for b in sorted(sc.batch_sizes) if step_mib(cfg, b, n_train, shape) <= sc.memory_budget_mb]
        high = max(fits, default=low)
    lr = scaled_lr(cfg.train.lr, cfg.train.batch_size, low, sc.lr_scaling)
    every = max(1, steps_per_epoch(n_train, high) // sc.evals_per_epoch)
    epochs = sc.epochs or cfg.train.epochs
    return [Experiment(low, seed, lr, epochs, eval_every_steps=every, adaptive=True, max_batch_size=high)
            for seed in sc.seeds]


def with_step_time(experiments: list[Experiment], clock: Table | None, cfg: Config) -> list[Experiment]:
    """The adaptive experiments given the time rule's step time: the sweep's throughput table's fit
    (train.adapt_step_time, when set, wins). Without a table (DDP/FSDP) the time rule needs it set."""
    if not any(e.adaptive for e in experiments) or cfg.train.adapt_rule != "time" or cfg.train.adapt_step_time:
        return experiments
    if clock is None:
        raise ConfigError("sweep.adaptive with train.adapt_rule time reads the throughput table, which a "
                          f"{cfg.train.strategy} sweep does not time: set train.adapt_step_time: [a, b] or "
                          "train.adapt_rule: statistical")
    return [dataclasses.replace(e, step_time=tuple(clock.step_time())) if e.adaptive else e for e in experiments]


def needs_schedule(experiments: list[Experiment], cfg: Config) -> bool:
    """sweep.adaptive under train.adapt_rule schedule with no train.adapt_schedule: the sweep's
    local CBS(t) is its schedule, so sweep.local_cbs must be on."""
    if not any(e.adaptive for e in experiments) or cfg.train.adapt_rule != "schedule" or cfg.train.adapt_schedule:
        return False
    if not cfg.sweep.local_cbs:
        raise ConfigError("sweep.adaptive with train.adapt_rule schedule takes the measured local CBS(t) as its "
                          "schedule: set sweep.local_cbs: true, or train.adapt_schedule")
    return True


def with_schedule(experiments: list[Experiment], schedule: list[tuple[float, int]]) -> list[Experiment]:
    """The adaptive experiments given the schedule rule's (share, batch) pairs."""
    if not schedule:
        raise ConfigError(
            "sweep.local_cbs measured no point (the base branch's val loss never fell), so there "
            "is no schedule for train.adapt_rule schedule: set train.adapt_schedule or another rule"
        )
    return [dataclasses.replace(e, schedule=tuple(schedule)) if e.adaptive else e for e in experiments]


def step_mib(cfg: Config, batch: int, n_train: int, shape: tuple[tuple[int, ...], int, int]) -> float:
    """The step memory the study reports for `batch` (probes.step_memory, measured once per batch)."""
    lr = scaled_lr(cfg.train.lr, cfg.train.batch_size, batch, cfg.sweep.lr_scaling)
    exp = Experiment(batch, 0, lr, 1, gns_every=steps_per_epoch(n_train, batch))
    return probes.step_memory(experiment_config(cfg, exp), *shape)["step_memory_mib"]


# what each adaptive rule does not read (the statistical rule: both)
UNREAD = {"time": ("adapt_schedule",), "schedule": ("adapt_step_time",)}
# the adaptive rule's keys at their defaults: a fixed row is keyed without them
ADAPTIVE_DEFAULTS = {k: f.default for k, f in TrainConfig.model_fields.items() if k.startswith(("adapt_", "max_batch"))}


def experiment_config(cfg: Config, exp: Experiment) -> Config:
    raw = cfg.model_dump()
    # identical conditions: the same epochs for everyone, so no early stopping
    raw["train"].update(batch_size=exp.batch_size, lr=exp.lr, seed=exp.seed, epochs=exp.epochs)
    raw["train"].update(
        early_stopping_patience=0,
        eval_every_steps=exp.eval_every_steps,
        curve_weights=exp.curve_weights,
        gns_every=exp.gns_every,
        adaptive_batch=False,  # a fixed row is fixed, whatever train.adaptive_batch says for `batchlab train`
        # and keyed without the adaptive rule's settings: a study under another rule reuses it
        **ADAPTIVE_DEFAULTS,
    )
    if exp.adaptive:  # its lr follows the sweep's rule, its step time the sweep's clock
        raw["train"].update({k: v for k, v in cfg.train.model_dump().items() if k.startswith("adapt_")})
        unread = UNREAD.get(cfg.train.adapt_rule, ("adapt_schedule", "adapt_step_time"))
        raw["train"].update({k: ADAPTIVE_DEFAULTS[k] for k in unread})  # keyed without what its rule does not read
        rule = cfg.sweep.lr_scaling
        raw["train"].update(adaptive_batch=True, max_batch_size=exp.max_batch_size, adapt_lr_scaling=rule)
        if exp.step_time is not None:
            raw["train"]["adapt_step_time"] = list(exp.step_time)
        if exp.schedule is not None:
            raw["train"]["adapt_schedule"] = [list(pair) for pair in exp.schedule]
    return parse_config(raw)


def keyed(cfg: Config, exp: Experiment, data_hash: str) -> Keyed:
    """`exp` with its config and its key (key_of)."""
    exp_cfg = experiment_config(cfg, exp)
    return Keyed(exp, exp_cfg, key_of(exp_cfg, data_hash))


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


def key_of(exp_cfg: Config, data_hash: str) -> str:
    """An experiment's key: its params (`exp_cfg`: experiment_config), the data and the code that
    measured it. model.factory's experiments also key on usermodels/ (its code, at the project
    root): an edit there re-measures them. The built-in models' keys stay as they were."""
    user = f"-{_tree_hash(Path.cwd() / 'usermodels')}" if exp_cfg.model.factory else ""
    return f"{exp_cfg.section_hash('model', 'train')}-{data_hash}-{code_hash()}{user}"


# the experiment's fingerprint on its child run (its result row: scoring.RESULT_ARTIFACT)
KEY_TAG = "sweep.key"


BATCH_TAG = "sweep.batch_size"  # a child's batch size as a tag: the sweep's MLflow view groups by it


def experiment_tags(exp: Experiment, key: str) -> dict[str, str]:
    return {
        BATCH_TAG: str(exp.batch_size),
        "sweep.seed": str(exp.seed),
        "sweep.lr_multiplier": f"{exp.lr_multiplier:g}",
        **({"sweep.adaptive": "true"} if exp.adaptive else {}),
        KEY_TAG: key,
    }
