"""What any grow-only batch schedule can reach on issue #42's goals: the adaptive row of each study
run under train.adapt_rule schedule with a grid of hand-written schedules (a starting batch, and one
grow at a share of the run's examples), against the same fixed rows, paired by seed with the
study's own tests (study/adaptive.py, Holm over every comparison), as bench_adaptive does.

A rule that reads the noise scale ends up taking some schedule of this kind, and pays for its
readings besides; so a goal no schedule here meets is one no such rule meets on that study either
(within the grid: a batch of 32-512 held from the first step, or a start of 16-64 grown once to
128-512 at 10% or 30% of the run's examples). The goals: not measurably slower to the target than the fastest fixed
batch, not measurably worse in test F1 than the best-F1 one, at least 40% fewer optimizer steps to
the target than that one.

    BATCHLAB_BENCH_STUDIES=default,CNN python benchmarks/run_all.py --only schedules
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_adaptive import RUN, STUDIES, run_study, study_config, verdict_row
from common import Table, keep_earlier, markdown, progress

# a batch held from the first step (BATCHLAB_BENCH_HELD=512: another) ...
HELD = tuple(int(b) for b in os.environ.get("BATCHLAB_BENCH_HELD", "32,64,128,256").split(","))
STARTS = (16, 32, 64)  # ... and a warmup's starting batch (BATCHLAB_BENCH_WARMUPS=0: none) ...
ENDS = (128, 256, 512)  # ... the batch it grows to ...
SHARES = (0.1, 0.3)  # ... at this share of the run's examples


def grid() -> list[list[tuple[float, int]]]:
    held = [[(0.0, b)] for b in HELD]
    warm = [[(0.0, s), (x, e)] for s in STARTS for e in ENDS for x in SHARES if e > s]
    return held + (warm if os.environ.get("BATCHLAB_BENCH_WARMUPS", "1") != "0" else [])


def label(schedule: list[tuple[float, int]]) -> str:
    return " → ".join(f"{int(b)}" if not s else f"{int(b)} at {s:.0%}" for s, b in schedule)


def main() -> dict[str, Any]:
    table = Table(
        "Grow-only batch schedules against the fixed batch sizes (5 seeds, paired by seed; * measurable, Holm "
        "over all comparisons; seconds on the study's clock; train.adapt_rule schedule, no readings)",
        ["study", "schedule", "s to target", "fastest fixed (s)", "Δ s vs fastest", "F1", "best F1 (batch)",
         "Δ F1 vs best", "steps vs best-F1 batch", "not slower / not worse / 40% fewer steps", "all three",
         "load", "measured"],
    )  # fmt: skip
    raw: dict[str, Any] = {}
    today = time.strftime("%Y-%m-%d")
    for name, overrides in RUN.items():
        # one folder a study: the fixed rows and the clock are measured once; each schedule retrains the
        # adaptive rows only (their key holds train.adapt_schedule)
        with tempfile.TemporaryDirectory() as tmp:
            for schedule in grid():
                progress(f"schedules: {name}, {label(schedule)}")
                train = {**overrides.get("train", {}), "adapt_schedule": schedule}
                cfg = study_config({**overrides, "train": train}, "schedule")
                cfg = cfg.model_copy(update={"sweep": cfg.sweep.model_copy(update={"local_cbs": False})})
                study, _ = run_study(cfg, Path(tmp))
                row, figures = verdict_row(study)
                goals = figures["goals"]
                everything = "yes" if all(goals.values()) else ""
                table.add(name, label(schedule), *row[:8], everything, f"{os.getloadavg()[0]:.2f}", today)
                progress(f"schedules: {name}, {label(schedule)}: " + " | ".join(row[:8]))
                raw[f"{name} / {label(schedule)}"] = {**figures, "schedule": schedule, "measured": today}
    order = {name: i for i, name in enumerate(STUDIES)}  # a partial run keeps the other rows
    keep_earlier(
        "schedules",
        "schedules",
        [table],
        raw,
        lambda r: f"{r[0]} / {r[1]}",
        lambda r: (order.get(r[0], len(order)), "→" in r[1], int(r[1].split()[0])),
    )
    tables = [table.as_dict()]
    print(markdown(tables))
    return {"tables": tables, "schedules": raw}


if __name__ == "__main__":
    main()
