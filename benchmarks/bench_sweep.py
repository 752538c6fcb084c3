"""The default batch-size sweep: wall time next to the sum of its experiments' training time,
and what tracking adds per experiment (the same sweep with tracking on and off)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from batchlab import stages, sweep
from batchlab.config import Config, load_config
from common import REPO, Table, markdown, progress, timed, working_dir

WALL_TARGET_S = 60.0  # issue: the default sweep finishes in under a minute on 2 cores
TRACKING_TARGET_S = 0.5  # issue: tracking costs at most 0.5 s per experiment


def run_once(cfg: Config, folder: Path) -> dict[str, Any]:
    with working_dir(folder):
        paths = stages.Paths(folder)
        stages.generate(cfg, paths)
        summary, wall = timed(lambda: sweep.run_sweep(cfg, paths))
        results = [json.loads(p.read_text()) for p in sorted(folder.glob("sweep/experiments/*/result.json"))]
    return {
        "wall_s": wall,
        "sum_train_s": sum(r["train_seconds"] for r in results),
        "experiments": len(results),
        "overhead_s": {r["name"]: r["overhead_seconds"] for r in results},
        "best_f1_batch_size": summary["best_f1_batch_size"],
        "fastest_within_1pt_batch_size": summary["fastest_within_1pt_batch_size"],
    }


def main() -> dict[str, Any]:
    base = load_config(REPO / "params.yaml")
    runs = {}
    for enabled in (False, True):
        progress(f"sweep: default sweep, tracking {'on' if enabled else 'off'}")
        with tempfile.TemporaryDirectory() as tmp:
            tracking = base.tracking.model_copy(update={"enabled": enabled, "tracking_uri": f"sqlite:///{tmp}/m.db"})
            runs["on" if enabled else "off"] = run_once(base.model_copy(update={"tracking": tracking}), Path(tmp))
    on, off = runs["on"], runs["off"]
    per_experiment = (on["wall_s"] - off["wall_s"]) / on["experiments"]
    # steady state: what tracking adds to a typical experiment, once the store exists and
    # mlflow's model-logging imports are paid (a one-off ~3 s per sweep, in the first experiment)
    added = sorted(on["overhead_s"][name] - off["overhead_s"][name] for name in on["overhead_s"])
    typical = added[len(added) // 2]
    title = f"Default sweep: {on['experiments']} batch sizes ({', '.join(map(str, base.sweep.batch_sizes))})"
    table = Table(title, ["tracking", "sweep wall s", "sum of training s", "other s per experiment"])
    for name, r in runs.items():
        other = (r["wall_s"] - r["sum_train_s"]) / r["experiments"]
        table.add(name, f"{r['wall_s']:.1f}", f"{r['sum_train_s']:.1f}", f"{other:.2f}")
    targets = Table("Sweep targets", ["target", "measured", "result"])
    targets.add("default sweep < 60 s", f"{on['wall_s']:.1f} s", "met" if on["wall_s"] < WALL_TARGET_S else "MISSED")
    targets.add(
        "tracking ≤ 0.5 s per experiment (median)",
        f"{typical:.2f} s (mean incl. one-off costs {per_experiment:.2f} s)",
        "met" if typical <= TRACKING_TARGET_S else "MISSED",
    )
    tables = [table.as_dict(), targets.as_dict()]
    print(markdown(tables))
    return {"runs": runs, "tracking_s_per_experiment": typical, "tracking_s_mean": per_experiment, "tables": tables}


if __name__ == "__main__":
    main()
