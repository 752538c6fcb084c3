"""The report's section on its clock: what samples/s and every figure in seconds were read from, as
the sweep stored it in reports/sweep/throughput.json (a dict: the study does no I/O). On one process
that is the throughput table (training/throughput.py), timed side by side (`source: table`); under
DDP and FSDP the table, which times one process, is not measured, and each experiment's seconds
are its own epochs' at their median speed (`source: epochs`, from_epochs)."""

from __future__ import annotations

import statistics
from typing import Any

EPOCHS = "epochs"  # the `source` of a clock read from each experiment's own epochs


def from_epochs(results: list[dict[str, Any]], run: dict[str, Any]) -> dict[str, Any]:
    """The clock of a sweep without a throughput table: each batch size's samples/s over its
    experiments (each one's median epoch), the median with the slowest and fastest beside it.
    `run`: how the experiments trained (strategy, processes, precision), which the file names."""
    speeds: dict[int, list[float]] = {}
    for r in results:
        if not r.get("adaptive"):  # an adaptive run's speed moves with its batch
            speeds.setdefault(int(r["batch_size"]), []).append(float(r["samples_per_s"]))
    rows = [
        {
            "batch_size": b,
            "samples_per_s": statistics.median(v),
            "samples_per_s_low": min(v),
            "samples_per_s_high": max(v),
            "experiments": len(v),
        }
        for b, v in sorted(speeds.items())
    ]
    return {"source": EPOCHS, **run, "rows": rows}


def heading(clock: dict[str, Any]) -> str:
    what = "each experiment's epochs" if clock.get("source") == EPOCHS else "throughput side by side"
    return f"## The clock: {what}"


def text(clock: dict[str, Any]) -> str:
    """What samples/s and every figure in seconds read: the throughput table, or the experiments' epochs."""
    if clock.get("source") == EPOCHS:
        return _epochs_text(clock)
    rounds = len(clock["entries"][0]["seconds"])
    a, b = clock["fit"]
    load = f"{clock['load_before'][0]:.2f} before, {clock['load_after'][0]:.2f} after"
    probe = clock.get("probe")
    probe_line = (
        f" The noise probe takes {1e3 * clock['probe_seconds']:.2f} ms a measurement "
        "(timed in the same rounds). Each experiment's seconds count its steps at its batch's speed; an adaptive "
        "run's also count each probe it took at this figure (it decides on them), a fixed one's do not (the study "
        "probes every experiment once an epoch to read the noise scale at the target: the study's cost)."
        if probe
        else " Each experiment's seconds count its steps at its batch's speed."
    )
    lines = [
        f"samples/s and every figure in seconds come from one table, timed side by side in {clock['seconds']:.1f} s: "
        f"{rounds} rounds, each one short window of training steps at every batch size in turn (the order rotated "
        "each round), so that load falls on all alike; the median over rounds with its order-statistic interval "
        f"(96% for 9 rounds). Load average (1 min) {load}, {clock['cores']} cores, {clock['threads']} torch "
        f"threads. Fitted step time t(B) = {1e3 * a:.3f} ms + {1e6 * b:.3f} µs × B.{probe_line}",
        "",
        "| batch | samples/s | interval | ms per step | fit (ms) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in clock["rows"]:
        lines.append(
            f"| {row['batch_size']} | {row['samples_per_s']:.0f} | {row['samples_per_s_low']:.0f}–"
            f"{row['samples_per_s_high']:.0f} | {row['step_ms']:.3f} | {row['fit_step_ms']:.3f} |"
        )
    return "\n".join(lines)


def _epochs_text(clock: dict[str, Any]) -> str:
    processes = clock["nproc"] * clock["nnodes"]
    lines = [
        f"samples/s and every figure in seconds come from each experiment's own epochs: train.strategy "
        f"{clock['strategy']} on {processes} process(es), {clock['precision']}. The side-by-side throughput table "
        "times one process, so it is not measured under DDP or FSDP: each experiment's seconds count its epochs' "
        "rows at the median speed of its epochs, timed while it trained. Batch sizes were timed at different "
        "moments, so load that came and went between them is not shared alike; compare seconds across batch "
        "sizes with that in mind (the table below gives each batch size's spread over its experiments).",
        "",
        "| batch | samples/s (median) | slowest–fastest | experiments |",
        "|---:|---:|---:|---:|",
    ]
    for row in clock["rows"]:
        lines.append(
            f"| {row['batch_size']} | {row['samples_per_s']:.0f} | {row['samples_per_s_low']:.0f}–"
            f"{row['samples_per_s_high']:.0f} | {row['experiments']} |"
        )
    return "\n".join(lines)
