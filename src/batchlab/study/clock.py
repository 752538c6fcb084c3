"""The report's section on its clock: the throughput table (training/throughput.py) that samples/s
and every figure in seconds read, as the sweep stored it (a dict: the study does no I/O)."""

from __future__ import annotations

from typing import Any


def text(clock: dict[str, Any]) -> str:
    """The throughput table (training/throughput.py) that samples/s and every figure in seconds read."""
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
