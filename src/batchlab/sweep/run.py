"""The whole batch-size sweep: plan its experiments, find those already finished, run the rest on
the executor sweep.executor names (local lanes or Dask), then analyse and report under one parent
MLflow run. An interrupted sweep resumes without redoing finished experiments, and a finished one
reruns as a no-op. One sweep at a time per folder: a second one is refused (SweepBusy).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

from batchlab import atomic, data, tracking
from batchlab.config import Config
from batchlab.paths import Paths
from batchlab.seeds import vectorized
from batchlab.study import analysis, clock, local_cbs, report
from batchlab.sweep import branches, executors, experiment, groups, plan, progress, speeds, tasks, truth
from batchlab.sweep import state as sweep_state
from batchlab.sweep.lock import exclusive
from batchlab.sweep.state import Sweep

log = logging.getLogger(__name__)


def prepare(cfg: Config, paths: Paths, executor: executors.Executor) -> Sweep:
    """Plan the experiments, find those an earlier sweep already finished, and read the throughput
    table every experiment's seconds are counted on, its task run through `executor` first where
    it is not stored (and, under the schedule rule, the seeds' branches the plan needs). Call it
    holding `exclusive`."""
    started = time.perf_counter()  # the sweep's wall time counts its clock's block
    dataset = data.load(paths.data)
    experiments = plan.plan(cfg, dataset.train.y.shape[0], dataset)
    apart = vectorized.sweep_trains_apart(cfg, lambda: dataset)  # the one answer: its tasks carry it
    lane = tasks.Lane(cfg, paths)  # before the parent run: these tasks open no child run
    if plan.needs_schedule(experiments, cfg):  # the adaptive row's batch warmup: CBS(t), measured first
        executor.run(lane, list(branches.work_items(cfg, paths, together=apart is None)))
        experiments = plan.with_schedule(experiments, local_cbs.schedule(local_points(cfg, paths, dataset)))
    timing = speeds.clock_work(cfg, paths, experiments, dataset)
    if timing is not None:  # the sweep's first step
        executor.run(lane, [timing])
    clock = speeds.stored(cfg, paths)
    experiments = plan.with_step_time(experiments, clock, cfg)
    data_hash = dataset.content_hash()
    key = sweep_key(cfg, data_hash)
    state = sweep_state.load(paths, key)
    finished = {}
    for exp in experiments:
        result_path = plan.folder_of(paths, exp).outputs / "result.json"
        done = experiment.read_result(result_path, plan.keyed(cfg, exp, data_hash).key)
        if done:
            finished[exp.name] = done
    earlier = sweep_state.earlier_wall_seconds(state, finished)
    sweep = Sweep(experiments, finished, key, state.get("parent_run_id"), earlier, state.get("reported"), started,
                  clock, apart)
    if sweep.up_to_date:
        log.info(
            "sweep: all %d experiments already finished; nothing to do (to re-measure: delete %s/; under "
            "`dvc exp run`, docs/sweep.md says how)",
            len(experiments),
            paths.outputs / "sweep",
        )
    elif finished:
        log.info("sweep: resuming, %d of %d experiments already finished", len(finished), len(experiments))
    return sweep


# where the experiments run, not what they measure: a sweep resumed on another scheduler (a
# restarted one's new address), executor or number of lanes is the same sweep, under the same parent run
PLACEMENT = {"executor", "dask_address", "parallel"}


def sweep_key(cfg: Config, data_hash: str) -> str:
    """The sweep's identity in its state.json: its model, train and sweep settings (PLACEMENT left
    out), the data and the code."""
    return f"{settings_digest(cfg)[:16]}-{data_hash}-{plan.code_hash()}"


def settings_digest(cfg: Config) -> str:
    """A sha256 of the model, train and sweep settings, PLACEMENT left out."""
    settings = cfg.model_dump(include={"model", "train", "sweep"}, exclude={"sweep": PLACEMENT})
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def origin_tags(executor: str) -> dict[str, str]:
    """Where a sweep's runs came from: what started it (`dvc`, `exp-<name>` for `dvc exp run`,
    `prefect-<flow run>`, `cli`) and where its experiments trained (`local`, `dask`). Its children
    get the parent's, since a Dask worker cannot see what started the sweep."""
    return {"batchlab.origin": tracking.origin(), "batchlab.executor": executor}


def sweep_name(cfg: Config, origin: str) -> str:
    """The parent run's name: what started it and what differs between sweeps, e.g.
    `dvc-sweep-single-fp32-bs16-512-3f9a2c` (the last part a hash of every model, train and sweep
    setting that is not placement, so two sweeps that differ in anything have different names)."""
    sizes, digest = cfg.sweep.batch_sizes, settings_digest(cfg)[:6]
    return f"{origin}-sweep-{cfg.train.strategy}-{cfg.train.precision}-bs{min(sizes)}-{max(sizes)}-{digest}"


def configuration(cfg: Config, tags: dict[str, str]) -> str:
    """The parent's description opens on this line: the sweep's configuration, and where it came from."""
    sweep, train = cfg.sweep, cfg.train
    model = cfg.model.factory or cfg.model.name
    return (
        f"Sweep of batch sizes {', '.join(map(str, sweep.batch_sizes))} × {len(sweep.seeds)} seed(s), "
        f"{sweep.epochs or train.epochs} epochs: {model} on {cfg.data.source} data, {train.strategy} "
        f"{train.precision}, {train.optimizer} at lr {train.lr:g} for batch {train.batch_size} "
        f"({sweep.lr_scaling} scaling); from {tags['batchlab.origin']}, trained {tags['batchlab.executor']}."
    )


@contextlib.contextmanager
def parent_run(cfg: Config, paths: Paths, sweep: Sweep, tags: dict[str, str]) -> Iterator[tracking.Tracker]:
    """The sweep's parent MLflow run, re-opened when resuming; none when the sweep is up to date
    (nothing new to log). `tags`: origin_tags."""
    if sweep.up_to_date:
        yield tracking.Tracker()
        return
    name = sweep_name(cfg, tags["batchlab.origin"])
    resuming = sweep.parent_run_id is not None
    with tracking.run(cfg.tracking, run_id=sweep.parent_run_id, name=None if resuming else name) as parent:
        sweep.parent_run_id = parent.run_id
        sweep_state.save(paths, sweep, sweep.wall_seconds, attempt_started_at=time.time(), reported=None)
        if not resuming:
            parent.log_params({**cfg.flat(), "sweep.n_experiments": len(sweep.experiments)})
            parent.set_tags({"sweep": "parent", **tags, **tracking.environment_tags()})
            parent.set_tags({tracking.NOTE: configuration(cfg, tags)})  # until the report replaces it
        try:
            yield parent
        except BaseException:
            # failed, Ctrl-C or SIGTERM: a resume adds to this attempt's time
            sweep_state.save(paths, sweep, sweep.elapsed(), attempt_started_at=None, reported=None)
            raise


def finish(
    cfg: Config,
    paths: Paths,
    sweep: Sweep,
    results: dict[str, dict[str, Any]],
    parent: tracking.Tracker,
    tags: dict[str, str],
) -> dict[str, Any]:
    """Analyse every experiment's result, write the report and log it on the parent run. It
    measures nothing: it reads what the sweep's tasks stored (result rows, branches, clock, truth).

    The report depends on the results and the stored wall time only, so an up-to-date sweep
    rewrites the same bytes (`dvc repro` deletes reports/sweep before the stage runs)."""
    ordered = sweep.rows(results)
    wall = sweep.wall_seconds if sweep.up_to_date else sweep.elapsed()
    folder = paths.reports / "sweep"
    dataset = data.load(paths.data)
    folders = {e.name: plan.folder_of(paths, e) for e in sweep.experiments}
    scored = truth.with_exact(folders, ordered, target_of(cfg, ordered))  # `ordered` stays the stored rows
    n_test = int(dataset.test.y.shape[0])
    result = analysis.analyse(scored, n_test, cfg.sweep.target_val_loss, cfg.sweep.memory_budget_mb)
    points = local_points(cfg, paths, dataset)
    run = training_setup(cfg)
    # what its seconds were read from: the side-by-side table, or (DDP/FSDP) each experiment's epochs
    timing = sweep.clock.to_dict() if sweep.clock is not None else clock.from_epochs(ordered, run)
    context = {
        "run": run,
        "lr_scaling": cfg.sweep.lr_scaling,
        "base_batch": cfg.train.batch_size,
        "optimizer": cfg.train.optimizer,
        "epochs": cfg.sweep.epochs or cfg.train.epochs,
        "memory_budget_mb": cfg.sweep.memory_budget_mb,
        "clock": timing,
        "local_cbs": points,
        "local_cbs_tolerance": cfg.sweep.local_cbs_tolerance,
    }
    atomic.write_json(folder / speeds.TABLE, timing)  # the report's copy of its clock, on every strategy
    markdown = report.write(result, folder, context)
    figures = {
        **result.figures(),
        **local_cbs.figures(points, report.b_crit_interval(result)),
        "sweep_wall_seconds": wall,
        "sum_train_seconds": sum(r["train_seconds"] for r in ordered),
    }
    atomic.write_json(folder / "sweep.json", figures)  # DVC metrics: figures only (the table is summary.md)
    summary = {**figures, "markdown": markdown}
    if sweep.up_to_date:
        return summary
    # one FINISHED child per experiment, whoever ran it: the runs its result rows name
    parent.end_duplicates(plan.KEY_TAG, {str(r["run_id"]) for r in ordered if r.get("run_id")})
    # the figures as one table of rounded tags (the run page's Tags), not one chart each; the
    # headline three as metrics too, so the runs table shows them as columns beside other sweeps
    parent.set_tags(study_tags(figures))
    parent.log_metrics({k: float(figures[k]) for k in HEADLINE if k in figures})
    parent.log_table(result.rows, "sweep/summary_table.json")
    parent.set_tags({tracking.NOTE: description(cfg, tags, result, markdown, parent)})
    for file in sorted(folder.iterdir()):
        parent.log_artifact(file, "sweep")
    sweep_state.save(paths, sweep, wall, attempt_started_at=None, reported=sweep_state.digest(ordered))
    return summary


def training_setup(cfg: Config) -> dict[str, Any]:
    """How the experiments trained, as the report and its clock name it."""
    train = cfg.train
    return {
        "strategy": train.strategy,
        "nproc": train.nproc,
        "nnodes": train.nnodes,
        "precision": train.precision,
        "grad_accum_steps": train.grad_accum_steps,
    }


def target_of(cfg: Config, rows: list[dict[str, Any]]) -> float:
    """The study's target val loss (analysis.target_of), over the result rows."""
    return analysis.target_of(analysis.pick_lrs(rows)[0], cfg.sweep.target_val_loss)[0]


def local_points(cfg: Config, paths: Paths, dataset: data.Dataset) -> list[local_cbs.Point]:
    """sweep.local_cbs's points as the branch tasks stored them (sweep/branches.py), estimated;
    none when off."""
    if not cfg.sweep.local_cbs:
        return []
    return local_cbs.points_of(branches.read(cfg, paths, dataset), cfg.sweep.local_cbs_tolerance)


TO_TARGET = ("steps_to_target", "examples_to_target", "seconds_to_target")  # logged on each child as summary.*


def study_tags(figures: dict[str, Any]) -> dict[str, str]:
    """The study's figures as the parent's tags, `study.<figure>`, floats to 4 significant digits."""
    return {f"study.{k}": f"{v:.4g}" if isinstance(v, float) else str(v) for k, v in figures.items()}


# the parent's metrics: the columns the runs table shows for every sweep (study.* tags hold the rest)
HEADLINE = ("recommended_batch_size", "best_f1_batch_size", "b_crit")


def description(
    cfg: Config, tags: dict[str, str], study: analysis.Study, markdown: str, parent: tracking.Tracker
) -> str:
    """The parent run's description in the MLflow UI: its configuration, the verdict's two lines, a
    link to the sweep's saved view (tracking/views.py), then the whole report. Each child gets its
    figures to the study's target (summary.seconds_to_target, …), which only the whole study knows,
    so the view charts them."""
    figures = {r["run_id"]: {f"summary.{k}": r[k] for k in TO_TARGET} for r in study.results if r.get("run_id")}
    parent.log_on_children(figures)
    link = parent.save_view(sweep_name(cfg, tags["batchlab.origin"]), "train.batch_size", plan.BATCH_TAG)
    view = (
        f"[The study's charts]({link}): its {len(figures)} experiments grouped by batch size; test F1, seconds "
        "and steps to the target against batch size, and the val-loss curves with their bands (docs/tracking.md).\n\n"
        if link
        else ""
    )
    return f"{configuration(cfg, tags)}\n{report.headline(study)}\n{view}{markdown}"


def run_counted(executor: executors.Executor, lane: tasks.Lane, sweep: Sweep) -> dict[str, dict[str, Any]]:
    """The experiments still to do, through `executor`, counted done / total with the time left;
    grouped here, once, into the work items every executor runs (groups.groups). With
    sweep.local_cbs, the seeds' branches not yet stored are work items too (one for the seeds
    together where they train together, else one per seed), queued first (the longest), so lanes
    and Dask workers run them beside the experiments, and the report reads them back (under the
    schedule rule they were measured before the plan: stored already)."""
    seeds = branches.work_items(lane.cfg, lane.paths, together=sweep.seeds_apart is None)
    if not sweep.todo and not seeds:
        return executor.run(lane, [])
    work: list[tasks.Work] = [*seeds, *(groups.groups(lane.cfg, sweep.todo, sweep.seeds_apart) if sweep.todo else [])]
    total = len(sweep.experiments) + len(seeds)  # each branch task counts as one
    with progress.counting(total, len(sweep.experiments) - len(sweep.todo)):
        return executor.run(lane, work)


def run_sweep(cfg: Config, paths: Paths) -> dict[str, Any]:
    """Run every experiment not already finished, then write the trade-off report."""
    executor = executors.for_sweep(cfg)  # its checks fail before anything runs
    with exclusive(paths):
        sweep = prepare(cfg, paths, executor)
        return run_prepared(cfg, paths, executor, sweep)


def run_prepared(cfg: Config, paths: Paths, executor: executors.Executor, sweep: Sweep) -> dict[str, Any]:
    """A prepared sweep: its parent run, its experiments (and branches) through `executor`, then,
    once the target is known, the truth tasks through it, then its report."""
    tags = origin_tags(executor.name)
    with parent_run(cfg, paths, sweep, tags) as parent:
        lane = tasks.Lane(cfg, paths, parent.run_id, sweep.clock, tags)
        results = run_counted(executor, lane, sweep)
        rows = sweep.rows(results)
        executor.run(lane, list(truth.work(paths, rows, target_of(cfg, rows))))
        return finish(cfg, paths, sweep, results, parent, tags)
