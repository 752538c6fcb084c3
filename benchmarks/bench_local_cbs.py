"""sweep.local_cbs on the default study, the CNN example and the transformer example (issue #44):
the local critical batch size at each point with its 95% interval, beside the exact B_simple at the
same weights and the in-training estimate there, the ratio CBS / B_simple with its interval, and
whether the time-average of CBS(t) falls inside the global B_crit interval. Cost: each study runs
once with sweep.local_cbs off (the study's wall time), then again with it on, which reuses every
finished experiment (their keys do not hold the sweep section), so the second wall time is the
branches' (and the report's): the goal is at most the study's own."""

from __future__ import annotations

import json
import os
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from batchlab import stages
from batchlab.config import Config
from batchlab.paths import Paths
from batchlab.sweep.run import run_sweep
from common import Table, keep_earlier, markdown, progress, shipped_params, timed, working_dir

STUDIES: dict[str, dict[str, Any]] = {
    "default (MLP, synthetic)": {},
    "CNN on digits_images": {"data": {"source": "digits_images"}, "model": {"name": "cnn"}},
    # its val loss stops falling at ~20% of its 20 epochs: points later than that find no fall in
    # the base branch to compare with ("not measured")
    "transformer on sequences": {
        "data": {"source": "sequences"},
        "model": {"name": "transformer"},
        "sweep": {"local_cbs_points": [0.05, 0.1, 0.15, 0.2]},
    },
}
# BATCHLAB_BENCH_STUDIES=default,CNN: the studies whose names start with these
CHOSEN = os.environ.get("BATCHLAB_BENCH_STUDIES", "").split(",")
RUN = {k: v for k, v in STUDIES.items() if any(k.startswith(c) for c in CHOSEN)}


def _config(overrides: dict[str, Any], local: bool) -> Config:
    return shipped_params(
        {**overrides, "sweep": {**overrides.get("sweep", {}), "local_cbs": local}, "tracking": {"enabled": False}}
    )


def _cell(figures: dict[str, Any], key: str, digits: int = 0) -> str:
    v = figures.get(key)
    return "–" if v is None else f"{v:.{digits}f}"


def main() -> dict[str, Any]:
    points = Table(
        "sweep.local_cbs: the local critical batch size through training (5 seeds; 95% interval on the grid; the "
        "ratio's interval off it: 0 below the run's own batch, ∞ past the grid)",
        ["study", "point", "epoch", "local CBS (interval)", "exact B_simple", "in-training estimate",
         "CBS / exact (interval)"],
    )  # fmt: skip
    totals = Table(
        "sweep.local_cbs: CBS(t) against the global B_crit, and its cost against the study's",
        ["study", "time-average CBS", "global B_crit (interval)", "inside", "study wall (s)", "branches wall (s)",
         "branches / study", "load", "measured"],
    )  # fmt: skip
    raw: dict[str, Any] = {}
    today = time.strftime("%Y-%m-%d")
    for name, overrides in RUN.items():
        progress(f"local_cbs: {name}")
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as tmp, working_dir(Path(tmp)):
            paths = Paths(Path(tmp))
            off, on = _config(overrides, False), _config(overrides, True)
            stages.generate(off, paths)
            _, study_wall = timed(partial(run_sweep, off, paths))
            found, branch_wall = timed(partial(run_sweep, on, paths))
        figures = {k: v for k, v in found.items() if k.startswith(("local_cbs", "b_crit"))}
        shares = sorted({k.split(".")[1] for k in figures if k.startswith("local_cbs.p")}, key=lambda s: int(s[1:]))
        for share in shares:
            f = {k.split(".", 2)[2]: v for k, v in figures.items() if k.startswith(f"local_cbs.{share}.")}
            # sweep.json holds finite figures only: a low end without a high one is unbounded
            high = _cell(f, "ratio_high", 2) if "ratio_high" in f or "ratio_low" not in f else "∞"
            ratio = f"{_cell(f, 'ratio_to_exact', 2)} ({_cell(f, 'ratio_low', 2)}–{high})"
            cbs = f"{_cell(f, 'cbs')} ({_cell(f, 'cbs_low')}–{_cell(f, 'cbs_high')})"
            if "cbs" not in f:  # the base branch made no progress there: no tolerance, nothing to test
                cbs = ratio = "not measured (the base branch's val loss did not fall)"
            points.add(name, f"{share[1:]}%", _cell(f, "epoch"), cbs, _cell(f, "b_simple_exact"),
                       _cell(f, "b_simple_estimate"), ratio)  # fmt: skip
        crit = f"{_cell(figures, 'b_crit')} ({_cell(figures, 'b_crit_ci95_low')}–{_cell(figures, 'b_crit_ci95_high')})"
        totals.add(name, _cell(figures, "local_cbs.mean"), crit, str(figures.get("local_cbs.mean_in_b_crit_interval",
                   "–")), f"{study_wall:.0f}", f"{branch_wall:.0f}", f"{branch_wall / study_wall:.2f}", f"{load:.2f}",
                   today)  # fmt: skip
        progress(f"local_cbs: {name}: branches {branch_wall:.0f} s against the study's {study_wall:.0f} s")
        raw[name] = {"figures": figures, "study_wall_s": study_wall, "branches_wall_s": branch_wall, "load": load,
                     "measured": today}  # fmt: skip
    order = {name: i for i, name in enumerate(STUDIES)}  # a partial run keeps the other studies' rows
    keep_earlier("local_cbs", "studies", [points, totals], raw, lambda r: r[0], lambda r: order.get(r[0], len(order)))
    tables = [points.as_dict(), totals.as_dict()]
    print(markdown(tables))
    print(json.dumps(raw, indent=1, default=str)[:2000])
    return {"tables": tables, "studies": raw}


if __name__ == "__main__":
    main()
