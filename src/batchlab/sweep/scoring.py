"""An experiment's result row: its test scores, speed, memory, val curve and (adaptive) batch
schedule, recorded in its child run as `summary.*` metrics and the row itself."""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from batchlab import data, evaluate
from batchlab.tracking import Tracker
from batchlab.training.throughput import Table
from batchlab.training.tracked import Trained

if TYPE_CHECKING:
    from batchlab.sweep.plan import Experiment

log = logging.getLogger(__name__)

# the experiment's result row, stored in its run before it ends FINISHED: a rerun of a finished
# experiment (Dask runs a task at least once) returns that row
RESULT_ARTIFACT = "sweep/result.json"


def _epoch_totals(
    history: list[dict[str, float]], batch_size: int, clock: Table | None, adaptive: bool
) -> dict[str, list[float]]:
    """Examples and training seconds since the start at each epoch's end: the seconds to the target
    (an adaptive run's throughput moves with its batch). An epoch's rows are its samples/s x its
    seconds. With the sweep's throughput table (`clock`) its seconds are its rows at the table's
    speed for its batch, every experiment on one clock measured side by side; an adaptive run's also
    count its noise probes at the table's seconds per probe (it decides on them: what adapting
    costs), a fixed one's do not (the study probes every experiment once an epoch to read the noise
    scale at the target: the study's cost, not the batch size's). Without a table (DDP/FSDP), at the
    median samples/s of its epochs at the same batch, so one epoch slowed by load moves them little."""
    rows = [round(h["samples_per_s"] * h["epoch_seconds"]) for h in history]
    batch = [int(h.get("batch_size", batch_size)) for h in history]  # an adaptive run's at the epoch's end
    if clock is not None:
        probes = [0.0] + [h.get("gns.probes", 0.0) for h in history]
        per_probe = clock.probe_seconds if adaptive else 0.0
        seconds = [r / clock.samples_per_s(b) + (probes[i + 1] - probes[i]) * per_probe
                   for i, (r, b) in enumerate(zip(rows, batch, strict=True))]
    else:
        speeds: dict[int, list[float]] = {}
        for b, h in zip(batch, history, strict=True):
            speeds.setdefault(b, []).append(h["samples_per_s"])
        typical = {b: statistics.median(v) for b, v in speeds.items()}
        seconds = [r / typical[b] for r, b in zip(rows, batch, strict=True)]
    return {"epoch_examples": list(itertools.accumulate(rows)),
            "epoch_train_seconds": list(itertools.accumulate(seconds))}


def _floats(rows: list[dict[str, float]], key: str) -> list[float]:
    return [float(row[key]) if key in row else math.nan for row in rows]


# a child run's own figures, under keys of their own (`summary.*`): logged under the per-epoch
# names, the runs table would show them as the last epoch's value. Its speed is named for what
# measured it: the sweep's side-by-side table (`_table`) or, for DDP/FSDP, its own epochs' median
SUMMARY = {
    "summary.test_f1_macro": "test_f1_macro",
    "summary.test_accuracy": "test_accuracy",
    "summary.train_seconds": "train_seconds",
    "summary.step_memory_mib": "step_memory_mib",
    "summary.peak_rss_mib": "peak_rss_mib",
    "summary.grad_norm_mean": "grad_norm_mean",
    "summary.gns_b_simple": "gns_b_simple",
}


def score(
    exp: Experiment,
    key: str,
    trained: Trained,
    dataset: data.Dataset,
    measured: dict[str, float],
    seconds: float,
    tracker: Tracker,
    clock: Table | None = None,
) -> dict[str, Any]:
    """Test a trained experiment and record its summary and result row in its run, still open;
    returns the row (`keep` writes it once the run has ended).
    `seconds`: its training's wall time so far (what is not train_seconds is overhead); `clock`: the
    sweep's throughput table, which its seconds to the target are counted on."""
    started = time.perf_counter() - seconds
    history, curve = trained.history, trained.val_curve
    accuracy, f1 = evaluate.split_accuracy_and_macro_f1(trained.model, dataset)
    train_seconds = sum(h["epoch_seconds"] for h in history)
    result = {
        **asdict(exp),
        "name": exp.name,
        "fingerprint": key,
        "run_id": trained.info.get("run_id"),
        "test_accuracy": accuracy,
        "test_f1_macro": f1,
        "samples_per_s": measured["samples_per_s"],
        "epoch_seconds": measured["epoch_seconds"],
        "train_seconds": train_seconds,
        "step_memory_mib": measured["step_memory_mib"],
        "step_memory_plain_mib": measured["step_memory_plain_mib"],
        "peak_rss_mib": max(h["peak_memory_mb"] for h in history),
        "grad_norm_mean": statistics.fmean(h["grad_norm_mean"] for h in history),
        "gns_b_simple": history[-1].get("gns.b_simple", math.nan),
        "curve_steps": [int(v) for v in _floats(curve, "step")],
        "curve_examples": [int(v) for v in _floats(curve, "examples")],
        # cumulative examples and training seconds at each epoch's end: the seconds to the target
        **_epoch_totals(history, exp.batch_size, clock, exp.adaptive),
        "clock": "table" if clock is not None else "epochs",  # what those seconds were counted on
        "batch_schedule": trained.info.get("batch_schedule", []),
        "curve_val_loss": _floats(curve, "val_loss"),
        "curve_b_simple": _floats(curve, "gns.b_simple"),
        "curve_b_simple_measured_at": _floats(curve, "gns.measured_at"),  # the weights each reading measured
    }
    result["overhead_seconds"] = time.perf_counter() - started - train_seconds
    result["finished_at"] = time.time()  # what a killed sweep's next attempt counts its wall time up to
    measured_by = "table" if clock is not None else "median"
    speed = {f"summary.{k}_{measured_by}": k for k in ("samples_per_s", "epoch_seconds")}
    summary = {**SUMMARY, **speed}
    tracker.log_metrics({key: float(result[k]) for key, k in summary.items() if math.isfinite(result[k])})
    tracker.log_dict(result, RESULT_ARTIFACT)
    log.info("sweep: %s f1 %.4f, %.0f samples/s", exp.name, result["test_f1_macro"], result["samples_per_s"])
    return result
