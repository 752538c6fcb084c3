"""sweep.local_cbs: train.batch_size's run, branched at points of its training with each batch
multiplier (training/branch.py), for every seed of the sweep; study/local_cbs.py reads the result.

The run is the sweep's own experiment at train.batch_size (the same config, so the same weights
at every epoch), trained here up to each point with its checkpoint kept there
(sweep/local_cbs/seed<s>/epoch-<e>.pt, the resume format). Each seed's branches are stored with a
key (the experiment's and the branching settings'), point by point: a rerun recomputes nothing, an
interrupted one resumes at the first unfinished point, an edit of the params, data or code
recomputes them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from batchlab import atomic, data
from batchlab.config import Config, ConfigError
from batchlab.paths import Paths
from batchlab.sweep.plan import Experiment, Keyed, keyed, probe_every, step_mib
from batchlab.training.branch import branch_loss
from batchlab.training.gns_exact import batch_coupled, exact_noise_scale
from batchlab.training.gns_probes import FullSplitProbe, at_saved_weights
from batchlab.training.optim import steps_per_epoch
from batchlab.training.strategy import session
from batchlab.training.train import fit, initial_model, split_tensors

log = logging.getLogger(__name__)


def folder(paths: Paths) -> Path:
    return paths.outputs / "sweep" / "local_cbs"


def branch_epochs(points: list[float], epochs: int) -> list[int]:
    """Each point's epoch: the end of the epoch nearest its share of the run, from 1 to epochs − 1
    (a branch needs a run before and after it), without repeats."""
    return sorted({min(max(round(p * epochs), 1), max(epochs - 1, 1)) for p in points})


def branch_examples(ks: list[int], cfg: Config, epochs: int, n_train: int) -> int:
    """The examples every branch trains: sweep.local_cbs_fraction of the run's, rounded to whole
    batches of every multiplier in `ks` (at least one of the largest)."""
    whole = math.lcm(*(k * cfg.train.batch_size for k in ks))
    return max(1, round(cfg.sweep.local_cbs_fraction * epochs * n_train / whole)) * whole


def base_experiment(cfg: Config, seed: int, n_train: int) -> Experiment:
    """The sweep's experiment at train.batch_size and `seed` (lr multiplier 1), probed as the sweep probes it."""
    b, epochs = cfg.train.batch_size, cfg.sweep.epochs or cfg.train.epochs
    every = max(1, steps_per_epoch(n_train, b) // cfg.sweep.evals_per_epoch)
    return Experiment(b, seed, cfg.train.lr, epochs, 1.0, every, False, probe_every(steps_per_epoch(n_train, b), every))


def settings_key(cfg: Config, experiment_key: str, ks: list[int]) -> str:
    """What a seed's stored branches depend on: the run's key and the branching settings (`ks`:
    the multipliers branched)."""
    sc = cfg.sweep
    settings = [sc.local_cbs_points, ks, sc.local_cbs_fraction, sc.lr_scaling, sc.exact_noise_rows]
    return f"{experiment_key}-{hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:12]}"


def multipliers(cfg: Config, dataset: data.Dataset) -> list[int]:
    """sweep.local_cbs_multipliers whose branch's step fits sweep.memory_budget_mb (the study's
    step-memory probe; all of them without a budget). The base branch always runs."""
    ks, budget = cfg.sweep.local_cbs_multipliers, cfg.sweep.memory_budget_mb
    if budget is None:
        return ks
    shape, n_train = (dataset.input_shape, dataset.n_classes, dataset.vocab), int(dataset.train.y.shape[0])
    fits = [k for k in ks if k == 1 or step_mib(cfg, k * cfg.train.batch_size, n_train, shape) <= budget]
    if len(fits) < 2:
        raise ConfigError(f"sweep.memory_budget_mb {budget:g} fits no branch batch above train.batch_size "
                          f"{cfg.train.batch_size} (sweep.local_cbs_multipliers {ks}): raise it, or set "
                          "sweep.local_cbs: false")  # fmt: skip
    if len(fits) < len(ks):
        log.info("local CBS: multipliers %s need more than sweep.memory_budget_mb %g MiB a step: not branched",
                 sorted(set(ks) - set(fits)), budget)  # fmt: skip
    return fits


def unfinished_seeds(cfg: Config, paths: Paths) -> list[int]:
    """The sweep's seeds whose branches are not all stored under their key: the work items the
    sweep's executor runs beside its experiments (none when sweep.local_cbs is off)."""
    if not cfg.sweep.local_cbs:
        return []
    dataset = data.load(paths.data)
    n_train, ks = int(dataset.train.y.shape[0]), multipliers(cfg, dataset)
    out = []
    for seed in cfg.sweep.seeds:
        _, key, where, at = _placed(cfg, paths, dataset, seed, n_train, ks)
        if [p["epoch"] for p in _read(where / "branches.json", key)] != at:
            out.append(seed)
    return out


def run_seed(cfg: Config, paths: Paths, seed: int) -> dict[str, Any]:
    """One seed's branches as a work item of the sweep (groups.train_work, in a lane or on a Dask
    worker): trained where not stored, and the stored file's content returned (`keep` puts it in
    the sweep's own folder when the worker's is another)."""
    dataset = data.load(paths.data)
    _seed(cfg, paths, dataset, seed, int(dataset.train.y.shape[0]), multipliers(cfg, dataset))
    return dict(json.loads((folder(paths) / f"seed{seed}" / "branches.json").read_text()))


def keep(paths: Paths, seed: int, stored: dict[str, Any]) -> None:
    """A seed's branches a worker computed, stored in this machine's folder too."""
    atomic.write_json(folder(paths) / f"seed{seed}" / "branches.json", stored)


def run(cfg: Config, paths: Paths, dataset: data.Dataset) -> list[dict[str, Any]]:
    """Every point's branches over the seeds: [{epoch, fraction, examples, batch, multipliers,
    start: [per seed], losses: [per seed][per multiplier], b_simple_exact, b_simple_estimate}]
    (the noise scale's, means over seeds)."""
    n_train, ks = int(dataset.train.y.shape[0]), multipliers(cfg, dataset)
    per_seed = [_seed(cfg, paths, dataset, seed, n_train, ks) for seed in cfg.sweep.seeds]
    out = []
    for i, first in enumerate(per_seed[0]):
        at = [s[i] for s in per_seed]
        out.append({
            "epoch": first["epoch"], "fraction": first["fraction"], "examples": first["examples"],
            "batch": cfg.train.batch_size, "multipliers": ks, "start": [p["start"] for p in at],
            "losses": [p["losses"] for p in at],
            "b_simple_exact": _mean([p["b_simple_exact"] for p in at]),
            "b_simple_estimate": _mean([p["b_simple_estimate"] for p in at]),
        })  # fmt: skip
    return out


def _mean(values: list[float]) -> float:
    finite = [v for v in values if v == v]
    return sum(finite) / len(finite) if len(finite) == len(values) and finite else math.nan


def _seed(
    cfg: Config, paths: Paths, dataset: data.Dataset, seed: int, n_train: int, ks: list[int]
) -> list[dict[str, Any]]:
    """One seed's points: those its stored file holds under the same key, the rest trained, each
    stored as it finishes (an interrupted seed resumes at its first unfinished point, its run from
    the last epoch checkpointed)."""
    job, key, where, at = _placed(cfg, paths, dataset, seed, n_train, ks)
    epochs, examples = job.exp.epochs, branch_examples(ks, cfg, job.exp.epochs, n_train)
    points = _stored(where / "branches.json", key, at)
    if len(points) == len(at):
        return points
    where.mkdir(parents=True, exist_ok=True)
    log.info("local CBS: seed %d, each branch trains %d examples (%.1f%% of the run: whole batches of every "
             "multiplier)%s", seed, examples, 100 * examples / (epochs * n_train),
             f"; resuming at epoch {at[len(points)]}" if points else "")  # fmt: skip
    for epoch in at[len(points) :]:
        with session(job.cfg.train) as strategy:  # resumes train.pt where an interrupted seed left it
            trained = fit(job.cfg, dataset, strategy, checkpoint=where / "train.pt", until=epoch)
        kept = where / f"epoch-{epoch}.pt"
        shutil.copyfile(where / "train.pt", kept)
        saved = torch.load(kept, map_location="cpu", weights_only=True)
        row, (exact, estimate) = trained.history[-1], _noise(cfg, dataset, saved)
        losses = [branch_loss(job.cfg, dataset, saved, k, examples) for k in ks]
        points.append({"epoch": epoch, "fraction": epoch / epochs, "examples": int(saved["state"]["examples"]),
                       "start": float(row["val_loss"]), "losses": losses,
                       "b_simple_exact": exact, "b_simple_estimate": estimate})  # fmt: skip
        atomic.write_json(where / "branches.json", {"key": key, "examples_per_branch": examples, "points": points})
        read = zip(ks, losses, strict=True)
        log.info("local CBS: seed %d, epoch %d: val loss %.4f -> %s", seed, epoch, row["val_loss"],
                 ", ".join(f"{k}x {v:.4f}" for k, v in read))  # fmt: skip
    return points


def _placed(
    cfg: Config, paths: Paths, dataset: data.Dataset, seed: int, n_train: int, ks: list[int]
) -> tuple[Keyed, str, Path, list[int]]:
    """A seed's base run, the key its branches are stored under, their folder and the points' epochs."""
    job = keyed(cfg, base_experiment(cfg, seed, n_train), dataset.content_hash())
    at = branch_epochs(cfg.sweep.local_cbs_points, job.exp.epochs)
    return job, settings_key(cfg, job.key, ks), folder(paths) / f"seed{seed}", at


def _read(file: Path, key: str) -> list[dict[str, Any]]:
    """The points a seed's file holds for `key`, in order (none: no file, or another key's)."""
    found = json.loads(file.read_text()) if file.is_file() else {}
    return list(found["points"]) if found.get("key") == key else []


def _stored(file: Path, key: str, epochs: list[int]) -> list[dict[str, Any]]:
    """The points a seed's file holds for `key`, to resume from. A file of another key or other
    epochs empties the folder (its checkpoints are another run's); with no file yet, a first
    attempt's train.pt stays (fit resumes it only where its fingerprint is this run's)."""
    points = _read(file, key)
    if [p["epoch"] for p in points] == epochs[: len(points)] and (points or not file.is_file()):
        return points
    shutil.rmtree(file.parent, ignore_errors=True)
    return []


def _noise(cfg: Config, dataset: data.Dataset, saved: dict[str, Any]) -> tuple[float, float]:
    """The exact B_simple at the checkpoint's weights and the in-training estimator's reading there
    (the probe training uses, pooled as at the saved weights): NaN where not computable (beyond
    sweep.exact_noise_rows, a model whose rows are coupled by batch statistics, or one vmap cannot
    take row by row)."""
    model = initial_model(cfg, dataset.input_shape, dataset.n_classes, dataset.vocab)
    model.load_state_dict(saved["model"])
    model.train()  # dropout on, as a training step has it
    if batch_coupled(model) is not None:
        return math.nan, math.nan
    x, y = split_tensors(dataset.train, torch.device("cpu"))
    exact = (
        exact_noise_scale(model, F.cross_entropy, x, y).b_simple
        if x.shape[0] <= cfg.sweep.exact_noise_rows
        else math.nan
    )
    reading = at_saved_weights(FullSplitProbe(model, F.cross_entropy, x, y), x.shape[0])
    return float(exact), reading.b_simple if reading is not None else math.nan
