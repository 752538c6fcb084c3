"""What narrows the local CBS's interval per second (issue #44): longer branches
(sweep.local_cbs_fraction) or more seeds. At 5 seeds and 5%-of-run branches most intervals span
the whole grid (bench_local_cbs). Each setting here branches the same study from scratch (its own
base runs: the branching settings are part of each seed's key), and the table gives, per setting,
the mean interval width in doublings over the measured points, how many points span the grid, and
the branches' wall time, side by side in one run with the load beside it. The last setting is
the default's branched with its seeds one after another: what training them together saves."""

from __future__ import annotations

import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_local_cbs
from batchlab import data, stages
from batchlab.config import Config
from batchlab.paths import Paths
from batchlab.seeds.vectorized import sweep_trains_apart
from batchlab.study import local_cbs
from batchlab.sweep import branches
from batchlab.training import threads
from common import Table, markdown, progress, shipped_params, timed, working_dir

# bench_local_cbs's studies but the transformer (its branches alone take ~7 min a setting)
STUDIES = {k: v for k, v in bench_local_cbs.STUDIES.items() if not k.startswith("transformer")}
# BATCHLAB_BENCH_STUDIES=default: the studies whose names start with these
CHOSEN = os.environ.get("BATCHLAB_BENCH_STUDIES", "").split(",")
RUN = {k: v for k, v in STUDIES.items() if any(k.startswith(c) for c in CHOSEN)}
# (seeds, branch fraction, seeds trained together): the reference first; the last, the default
# branched with its seeds one after another (sweep.vectorize_seeds false), side by side
SETTINGS = [(5, 0.05, True), (5, 0.1, True), (5, 0.2, True), (10, 0.05, True), (5, 0.2, False)]


def _config(overrides: dict[str, Any], seeds: int, fraction: float, together: bool) -> Config:
    sweep = {"local_cbs": True, "seeds": list(range(seeds)), "local_cbs_fraction": fraction,
             "vectorize_seeds": together}  # fmt: skip
    return shipped_params({**overrides, "sweep": sweep, "tracking": {"enabled": False}})


def widths(points: list[local_cbs.Point]) -> tuple[float, int, int]:
    """The mean interval width in doublings over the measured points, how many span the grid, how many were measured."""
    measured = [p.result for p in points if p.result.measured]
    if not measured:
        return math.nan, 0, 0
    mean = sum(math.log2(r.high / r.low) for r in measured) / len(measured)
    return mean, sum(r.spans_grid for r in measured), len(measured)


def main() -> dict[str, Any]:
    table = Table(
        "sweep.local_cbs: the interval's width against branch length and seeds (4 points, multipliers 1–16, "
        "tolerance 0.1; width in doublings, 4 = the whole grid)",
        ["study", "seeds", "branch fraction", "seeds trained", "mean width (doublings)", "points spanning the grid",
         "branches wall (s)", "wall / reference", "load"],
    )  # fmt: skip
    raw: dict[str, Any] = {}
    for name, overrides in RUN.items():
        reference = math.nan
        for seeds, fraction, together in SETTINGS:
            how = "together" if together else "one after another"
            progress(f"local_cbs_width: {name}, {seeds} seeds {how}, fraction {fraction}")
            load = os.getloadavg()[0]
            cfg = _config(overrides, seeds, fraction, together)
            with tempfile.TemporaryDirectory() as tmp, working_dir(Path(tmp)):
                paths = Paths(Path(tmp))
                stages.generate(cfg, paths)
                dataset = data.load(paths.data)
                threads.use_threads(threads.sweep_threads(cfg, data.shape(paths.data)))  # as a sweep's branches
                together = sweep_trains_apart(cfg, lambda: dataset) is None  # noqa: B023
                raw_points, wall = timed(lambda: branches.run(cfg, paths, dataset, together))  # noqa: B023
            points = local_cbs.points_of(raw_points, cfg.sweep.local_cbs_tolerance)
            width, spanning, measured = widths(points)
            reference = wall if math.isnan(reference) else reference
            table.add(name, seeds, fraction, how, f"{width:.2f}", f"{spanning} of {measured}", f"{wall:.0f}",
                      f"{wall / reference:.2f}", f"{load:.2f}")  # fmt: skip
            raw[f"{name}|{seeds}|{fraction}|{how}"] = {
                "width_doublings": width, "spanning": spanning, "measured": measured, "wall_s": wall, "load": load,
                "cbs": [[p.result.multiplier, p.result.low, p.result.high] if p.result.measured else None
                        for p in points],
                "measured_on": time.strftime("%Y-%m-%d"),
            }  # fmt: skip
    tables = [table.as_dict()]
    print(markdown(tables))
    return {"tables": tables, "settings": raw}


if __name__ == "__main__":
    main()
