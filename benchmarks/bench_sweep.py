"""The default batch-size study: wall time next to the sum of its experiments' training time,
what tracking adds per experiment (the same study with tracking on and off), what the study's
own probes (the throughput table, step memory) cost, the default seeds against one seed by the sweep's wall
figure, and the study's answer (B_crit, its interval, R², B_simple, the recommended batch size)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from batchlab import stages
from batchlab.config import Config, load_config
from batchlab.paths import Paths
from batchlab.sweep import probes, speeds
from batchlab.sweep.run import run_sweep
from common import REPO, Table, markdown, progress, timed, working_dir

WALL_TARGET_S = 90.0  # issue #11: the default study (6 batch sizes x its seeds) in at most 90 s on 2 cores
R2_TARGET = 0.9  # issue #11: the critical-batch fit is meaningful on the default study
TRACKING_TARGET_S = 0.5  # issue: tracking costs at most 0.5 s per experiment
PROBES_TARGET = 0.15  # issue #26: the probes cost at most 15% of the default study's wall time
SEEDS_TARGET = 2.0  # issue #26: the default seeds at most 2x one seed's sweep wall time


# the unwrapped functions: the throughput table (measured once per sweep folder) and the step memory
PROBES = {(speeds, "measure"): speeds.measure, (probes, "step_memory"): probes.step_memory}


def _timing_probes() -> dict[str, float]:
    """Wrap the study's probes to add up their seconds in this process; their caches emptied first."""
    spent = {"probes_s": 0.0}
    for (module, name), probe in PROBES.items():

        def timed_probe(*args: Any, _probe: Any = probe) -> Any:
            result, seconds = timed(lambda: _probe(*args))
            spent["probes_s"] += seconds
            return result

        setattr(module, name, timed_probe)
    probes._STEP_MEMORY.clear()
    return spent


def run_once(cfg: Config, folder: Path) -> dict[str, Any]:
    with working_dir(folder):
        paths = Paths(folder)
        stages.generate(cfg, paths)
        spent = _timing_probes()
        summary, wall = timed(lambda: run_sweep(cfg, paths))
        results = [json.loads(p.read_text()) for p in sorted(folder.glob("sweep/experiments/*/result.json"))]
    return {
        "wall_s": wall,
        "sum_train_s": sum(r["train_seconds"] for r in results),
        "experiments": len(results),
        "probes_s": spent["probes_s"],
        "overhead_s": {r["name"]: r["overhead_seconds"] for r in results},
        "answer": {k: v for k, v in summary.items() if k != "markdown"},
    }


def main() -> dict[str, Any]:
    base = load_config(REPO / "params.yaml")
    runs = {}
    for enabled in (False, True):
        progress(f"sweep: default sweep, tracking {'on' if enabled else 'off'}")
        with tempfile.TemporaryDirectory() as tmp:
            tracking = base.tracking.model_copy(update={"enabled": enabled, "tracking_uri": f"sqlite:///{tmp}/m.db"})
            runs["on" if enabled else "off"] = run_once(base.model_copy(update={"tracking": tracking}), Path(tmp))
    progress("sweep: one seed, tracking off")
    with tempfile.TemporaryDirectory() as tmp:
        one = base.model_copy(update={"sweep": base.sweep.model_copy(update={"seeds": [0]})})
        tracking = base.tracking.model_copy(update={"enabled": False})
        runs["off, 1 seed"] = run_once(one.model_copy(update={"tracking": tracking}), Path(tmp))
    on, off = runs["on"], runs["off"]
    per_experiment = (on["wall_s"] - off["wall_s"]) / on["experiments"]
    # steady state: what tracking adds to a typical experiment, once the store exists and
    # mlflow's model-logging imports are paid (a one-off ~3 s per sweep, in the first experiment)
    added = sorted(on["overhead_s"][name] - off["overhead_s"][name] for name in on["overhead_s"])
    typical = added[len(added) // 2]
    sizes = ", ".join(map(str, base.sweep.batch_sizes))
    title = f"Default study: {on['experiments']} experiments (batch sizes {sizes} x {len(base.sweep.seeds)} seeds)"
    table = Table(title, ["tracking", "sweep wall s", "sum of training s", "probes s", "other s per experiment"])
    for name, r in runs.items():
        other = (r["wall_s"] - r["sum_train_s"] - r["probes_s"]) / r["experiments"]
        table.add(name, f"{r['wall_s']:.1f}", f"{r['sum_train_s']:.1f}", f"{r['probes_s']:.1f}", f"{other:.2f}")
    targets = Table("Sweep targets", ["target", "measured", "result"])
    targets.add("default study ≤ 90 s", f"{on['wall_s']:.1f} s", "met" if on["wall_s"] <= WALL_TARGET_S else "MISSED")
    share = off["probes_s"] / off["wall_s"]
    targets.add("probes ≤ 15% of the study's wall time (tracking off)", f"{share:.0%}",
                "met" if share <= PROBES_TARGET else "MISSED")  # fmt: skip
    ratio = off["wall_s"] / runs["off, 1 seed"]["wall_s"]
    targets.add(f"{len(base.sweep.seeds)} seeds ≤ 2× one seed (sweep wall, tracking off)", f"{ratio:.2f}×",
                "met" if ratio <= SEEDS_TARGET else "MISSED")  # fmt: skip
    r2 = on["answer"].get("fit_r2", float("nan"))
    targets.add("critical-batch fit R² ≥ 0.9", f"{r2:.3f}", "met" if r2 >= R2_TARGET else "MISSED")
    targets.add(
        "tracking ≤ 0.5 s per experiment (median)",
        f"{typical:.2f} s (mean incl. one-off costs {per_experiment:.2f} s)",
        "met" if typical <= TRACKING_TARGET_S else "MISSED",
    )
    a = on["answer"]
    answer = Table("The default study's answer (tracking on)", ["figure", "value"])
    for key in ("b_crit", "b_crit_ci95_low", "b_crit_ci95_high", "b_excess20", "b_excess20_ci95_low",
                "b_excess20_ci95_high", "s_min", "e_min", "fit_r2", "b_simple_exact_at_target",
                "b_crit_over_b_simple_exact", "b_simple_at_target", "b_simple_estimate_over_exact",
                "b_simple_unread_at_target", "target_val_loss", "best_f1_batch_size",
                "recommended_batch_size"):  # fmt: skip
        if key in a:
            answer.add(key, f"{a[key]:.4g}")
    tables = [table.as_dict(), targets.as_dict(), answer.as_dict()]
    print(markdown(tables))
    return {"runs": runs, "tracking_s_per_experiment": typical, "tracking_s_mean": per_experiment, "tables": tables}


if __name__ == "__main__":
    main()
