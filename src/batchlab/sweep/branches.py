"""sweep.local_cbs: train.batch_size's run, branched at points of its training with each batch
multiplier (training/branch.py), for every seed of the sweep; study/local_cbs.py reads the result.

The run is the sweep's own experiment at train.batch_size (the same config, so the same weights
at every epoch), trained here up to each point with its checkpoint kept there
(sweep/local_cbs/seed<s>/epoch-<e>.pt, the resume format). Each seed's branches are stored with a
key (the experiment's and the branching settings'), point by point: a rerun recomputes nothing, an
interrupted one resumes at the first unfinished point, an edit of the params, data or code
recomputes them. Where the sweep's seeds train together (the sweep's one answer, as its
experiments do), the seeds' runs to each point and each multiplier's branches train together
(seeds/branches.py), and all seeds' branches are one task (tasks.Branches) of the executor.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any

from batchlab import atomic, data, kept
from batchlab.config import Config, ConfigError
from batchlab.paths import Paths
from batchlab.seeds import branches as seeds_branches
from batchlab.sweep.plan import Experiment, Keyed, keyed, probe_every, step_mib
from batchlab.sweep.tasks import Branches
from batchlab.training.optim import steps_per_epoch

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
                          "sweep.local_cbs: false")
    if len(fits) < len(ks):
        log.info("local CBS: multipliers %s need more than sweep.memory_budget_mb %g MiB a step: not branched",
                 sorted(set(ks) - set(fits)), budget)
    return fits


def work_items(cfg: Config, paths: Paths, together: bool) -> list[Branches]:
    """The seeds whose branches are not all stored under their key, as the sweep's executor runs
    them beside its experiments: all in one task where the sweep's seeds train together
    (`together`: the sweep's one answer, run.prepare's), else one each (none when sweep.local_cbs
    is off)."""
    if not cfg.sweep.local_cbs:
        return []
    dataset = data.load(paths.data)
    n_train, ks = int(dataset.train.y.shape[0]), multipliers(cfg, dataset)
    seeds = [seed for seed in cfg.sweep.seeds if _complete(cfg, paths, dataset, seed, n_train, ks) is None]
    if len(seeds) < 2 or not together:
        return [Branches((seed,), together) for seed in seeds]
    return [Branches(tuple(seeds), together)]


def run_seeds(cfg: Config, paths: Paths, work: Branches) -> dict[str, Any]:
    """Seeds' branches as a task of the sweep (groups.train_work, in a lane or on a Dask worker):
    trained where not stored, and each stored file's content returned by seed (`keep` puts them in
    the sweep's own folder when the worker's is another)."""
    dataset = data.load(paths.data)
    n_train, ks = int(dataset.train.y.shape[0]), multipliers(cfg, dataset)
    _seeds(cfg, paths, dataset, list(work.seeds), n_train, ks, work.together)
    return {str(seed): json.loads((folder(paths) / f"seed{seed}" / "branches.json").read_text()) for seed in work.seeds}


def keep(paths: Paths, stored: dict[str, Any]) -> None:
    """The seeds' branches a worker computed (run_seeds' result), stored in this machine's folder too."""
    for seed, content in stored.items():
        atomic.write_json(folder(paths) / f"seed{seed}" / "branches.json", content)


def run(cfg: Config, paths: Paths, dataset: data.Dataset, together: bool) -> list[dict[str, Any]]:
    """Every point's branches over the seeds, trained here where not stored (`together`: whether
    the sweep's seeds train together), as `read` gives them."""
    n_train, ks = int(dataset.train.y.shape[0]), multipliers(cfg, dataset)
    points = _seeds(cfg, paths, dataset, list(cfg.sweep.seeds), n_train, ks, together)
    return _over_seeds(cfg, [points[seed] for seed in cfg.sweep.seeds], ks)


def read(cfg: Config, paths: Paths, dataset: data.Dataset) -> list[dict[str, Any]]:
    """Every point's branches over the seeds, as the branch tasks stored them: [{epoch, fraction,
    examples, batch, multipliers, start: [per seed], losses: [per seed][per multiplier],
    b_simple_exact, b_simple_estimate}] (the noise scale's, means over seeds). A seed not measured
    to every point is an error: the sweep runs its tasks first."""
    n_train, ks = int(dataset.train.y.shape[0]), multipliers(cfg, dataset)
    per_seed = []
    for seed in cfg.sweep.seeds:
        points = _complete(cfg, paths, dataset, seed, n_train, ks)
        if points is None:
            raise RuntimeError(f"local CBS: seed {seed}'s branches are not all stored in {folder(paths)}")
        per_seed.append(points)
    return _over_seeds(cfg, per_seed, ks)


def _complete(
    cfg: Config, paths: Paths, dataset: data.Dataset, seed: int, n_train: int, ks: list[int]
) -> list[dict[str, Any]] | None:
    """A seed's stored points when its file holds every point under its key, else None."""
    _, key, where, at = _placed(cfg, paths, dataset, seed, n_train, ks)
    points = _read(where / "branches.json", key)
    return points if [p["epoch"] for p in points] == at else None


def _over_seeds(cfg: Config, per_seed: list[list[dict[str, Any]]], ks: list[int]) -> list[dict[str, Any]]:
    out = []
    for i, first in enumerate(per_seed[0]):
        at = [s[i] for s in per_seed]
        out.append({
            "epoch": first["epoch"], "fraction": first["fraction"], "examples": first["examples"],
            "batch": cfg.train.batch_size, "multipliers": ks, "start": [p["start"] for p in at],
            "losses": [p["losses"] for p in at],
            "b_simple_exact": _mean([p["b_simple_exact"] for p in at]),
            "b_simple_estimate": _mean([p["b_simple_estimate"] for p in at]),
        })
    return out


def _mean(values: list[float]) -> float:
    finite = [v for v in values if v == v]
    return sum(finite) / len(finite) if len(finite) == len(values) and finite else math.nan


def _seeds(
    cfg: Config, paths: Paths, dataset: data.Dataset, seeds: list[int], n_train: int, ks: list[int], together: bool
) -> dict[int, list[dict[str, Any]]]:
    """Each seed's points: those its stored file holds under the same key, the rest trained, the
    seeds at the same point together where the sweep's seeds train together, else one by one."""
    placed = {seed: _placed(cfg, paths, dataset, seed, n_train, ks) for seed in seeds}
    points = {seed: _stored(where / "branches.json", key, at) for seed, (_, key, where, at) in placed.items()}
    todo = [seed for seed in seeds if len(points[seed]) < len(placed[seed][3])]
    if not todo:
        return points
    if not together:
        parts = [[seed] for seed in todo]
    else:  # seeds that resume at one point train together
        by_done: dict[int, list[int]] = {}
        for seed in todo:
            by_done.setdefault(len(points[seed]), []).append(seed)
        parts = list(by_done.values())
    for part in parts:
        _train_points(cfg, dataset, [placed[seed] for seed in part], [points[seed] for seed in part], ks)
    return points


def _train_points(
    cfg: Config, dataset: data.Dataset, placed: list[tuple[Keyed, str, Path, list[int]]],
    points: list[list[dict[str, Any]]], ks: list[int],
) -> None:
    """The seeds' points not yet stored (`points`, appended to: the same count for every seed),
    each stored as it finishes: their runs to each point (resumed from train.pt where interrupted),
    then every multiplier's branches."""
    jobs, wheres, at = [p[0] for p in placed], [p[2] for p in placed], placed[0][3]
    epochs, n_train = jobs[0].exp.epochs, int(dataset.train.y.shape[0])
    examples = branch_examples(ks, cfg, epochs, n_train)
    for where in wheres:
        where.mkdir(parents=True, exist_ok=True)
    done = len(points[0])
    log.info("local CBS: seeds %s, each branch trains %d examples (%.1f%% of the run: whole batches of every "
             "multiplier)%s", ", ".join(str(j.exp.seed) for j in jobs), examples, 100 * examples / (epochs * n_train),
             f"; resuming at epoch {at[done]}" if done else "")
    cfgs = [job.cfg for job in jobs]
    steps = seeds_branches.run_to_points(cfgs, dataset, wheres, at[done:], ks, examples, cfg.sweep.exact_noise_rows)
    for epoch, figures in steps:
        for i, (job, where, figure) in enumerate(zip(jobs, wheres, figures, strict=True)):
            points[i].append({"epoch": epoch, "fraction": epoch / epochs, **figure})
            atomic.write_json(where / "branches.json", {"key": placed[i][1], "examples_per_branch": examples,
                                                        "points": points[i]})
            log.info("local CBS: seed %d, epoch %d: val loss %.4f -> %s", job.exp.seed, epoch, figure["start"],
                     ", ".join(f"{k}x {v:.4f}" for k, v in zip(ks, figure["losses"], strict=True)))


def _placed(
    cfg: Config, paths: Paths, dataset: data.Dataset, seed: int, n_train: int, ks: list[int]
) -> tuple[Keyed, str, Path, list[int]]:
    """A seed's base run, the key its branches are stored under, their folder and the points' epochs."""
    job = keyed(cfg, base_experiment(cfg, seed, n_train), dataset.content_hash())
    at = branch_epochs(cfg.sweep.local_cbs_points, job.exp.epochs)
    return job, settings_key(cfg, job.key, ks), folder(paths) / f"seed{seed}", at


def _read(file: Path, key: str) -> list[dict[str, Any]]:
    """The points a seed's file holds for `key`, in order (none: no file, or another key's)."""
    found = kept.read(file, key)
    return list(found["points"]) if found is not None else []


def _stored(file: Path, key: str, epochs: list[int]) -> list[dict[str, Any]]:
    """The points a seed's file holds for `key`, to resume from. A file of another key or other
    epochs empties the folder (its checkpoints are another run's); with no file yet, a first
    attempt's train.pt stays (fit resumes it only where its fingerprint is this run's)."""
    points = _read(file, key)
    if [p["epoch"] for p in points] == epochs[: len(points)] and (points or not file.is_file()):
        return points
    shutil.rmtree(file.parent, ignore_errors=True)
    return []
