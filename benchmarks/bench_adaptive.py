"""sweep.adaptive on the default study and on the CNN example (docs/own-model.md): the adaptive
row's seconds to the target against the fastest fixed batch size and the median one, and its test
F1 against the best, each paired by seed with the study's own tests (study/adaptive.py). The goal
(issue #28): not measurably slower than the fastest fixed size and not measurably worse in F1
than the best, which no fixed size achieves on both."""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from batchlab import stages
from batchlab.config import Config, load_config
from batchlab.paths import Paths
from batchlab.study import analysis
from batchlab.sweep.run import run_sweep
from common import REPO, Table, markdown, progress, timed, working_dir

STUDIES: dict[str, dict[str, Any]] = {
    "default (MLP, synthetic)": {},
    "CNN on digits_images": {"data": {"source": "digits_images"}, "model": {"name": "cnn"}},
}


def _config(overrides: dict[str, Any]) -> Config:
    base = load_config(REPO / "params.yaml")
    sections = {}
    for section, values in {**overrides, "sweep": {"adaptive": True}, "tracking": {"enabled": False}}.items():
        sections[section] = getattr(base, section).model_copy(update=values)
    return base.model_copy(update=sections)


def _study(cfg: Config, folder: Path) -> tuple[analysis.Study, float]:
    with working_dir(folder):
        paths = Paths(folder)
        stages.generate(cfg, paths)
        _, wall = timed(lambda: run_sweep(cfg, paths))
        rows = [json.loads(p.read_text()) for p in sorted(folder.glob("sweep/experiments/*/result.json"))]
        n_test = json.loads((folder / "data/prepared/dataset.json").read_text())["splits"]["test"]["rows"]
    return analysis.analyse(rows, n_test, cfg.sweep.target_val_loss, cfg.sweep.memory_budget_mb), wall


def _cell(mean: float, half: float, digits: int) -> str:
    return f"{mean:.{digits}f} ± {half:.{digits}f}" if half == half else f"{mean:.{digits}f}"


def main() -> dict[str, Any]:
    table = Table(
        "sweep.adaptive: the adaptive row against the fixed batch sizes (5 seeds, paired by seed; * measurable, "
        "Holm over all comparisons)",
        ["study", "adaptive s to target", "fastest fixed (s)", "Δ s vs fastest", "median fixed (s)",
         "adaptive F1", "best F1 (batch)", "Δ F1 vs best", "goal", "schedule (seed 0)", "study wall (s)"],
    )  # fmt: skip
    raw: dict[str, Any] = {}
    for name, overrides in STUDIES.items():
        progress(f"adaptive: {name}")
        with tempfile.TemporaryDirectory() as tmp:
            study, wall = _study(_config(overrides), Path(tmp))
        assert study.adaptive is not None
        reached = {r["batch_size"]: r["seconds_to_target_mean"] for r in study.rows if r["reached"] == r["seeds"]}
        fastest = min(reached, key=lambda b: reached[b])
        median = statistics.median(reached.values())
        best = study.verdict.best
        sec, f1 = study.adaptive.figures["seconds_to_target"], study.adaptive.figures["test_f1_macro"]
        vs_fast, vs_best = (
            study.adaptive.against(fastest, "seconds_to_target"),
            study.adaptive.against(best, "test_f1_macro"),
        )
        goal = not (vs_fast.measurable and vs_fast.diff_mean > 0) and not (vs_best.measurable and vs_best.diff_mean < 0)
        seed0 = next(r for r in study.adaptive.results if r["seed"] == min(x["seed"] for x in study.adaptive.results))
        schedule = " → ".join(
            [str(seed0["batch_schedule"][0]["from"])]
            + [str(d["to"]) for d in seed0["batch_schedule"] if d["to"] != d["from"]]
        )
        best_f1 = next(r["test_f1_macro_mean"] for r in study.rows if r["batch_size"] == best)
        table.add(
            name, _cell(*sec, 2), f"{reached[fastest]:.2f} (batch {fastest})",
            _cell(vs_fast.diff_mean, vs_fast.diff_ci95, 2) + (" *" if vs_fast.measurable else ""),
            f"{median:.2f}", _cell(*f1, 4), f"{best_f1:.4f} ({best})",
            _cell(vs_best.diff_mean, vs_best.diff_ci95, 4) + (" *" if vs_best.measurable else ""),
            "met" if goal else "not met", schedule, f"{wall:.0f}",
        )  # fmt: skip
        raw[name] = {"figures": study.figures(), "adaptive_seconds": sec, "adaptive_f1": f1, "fastest": fastest,
                     "median_fixed_seconds": median, "goal_met": goal, "wall_s": wall}  # fmt: skip
    tables = [table.as_dict()]
    print(markdown(tables))
    return {"tables": tables, "studies": raw}


if __name__ == "__main__":
    main()
