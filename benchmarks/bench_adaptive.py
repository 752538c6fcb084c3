"""sweep.adaptive on the default study, the CNN example and the transformer example (docs/own-model.md),
under each rule (train.adapt_rule: time, statistical, and schedule: the local CBS(t) that
sweep.local_cbs measures, as a batch warmup): the adaptive row's seconds to the target
against the fastest fixed batch size, its test F1 against the best-F1 one and its optimizer steps
against that one's, each paired by seed with the study's own tests (study/adaptive.py, Holm over
every comparison). The goals (issue #42): not measurably slower than the fastest fixed batch, not
measurably worse in F1 than the best, at least 40% fewer steps than the best-F1 batch size. Seconds
are on the study's clock (the throughput table, timed side by side; an adaptive run's include each
probe it took), so they compare within a study whatever the load. The rules of a study share one
folder: the first trains the fixed rows, the next reuse them and train their adaptive row only
(and, for schedule, the branches), so "wall" is the study's for the first rule and the added
cost for the others."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from batchlab import stages
from batchlab.config import Config
from batchlab.paths import Paths
from batchlab.study import analysis
from batchlab.sweep.run import run_sweep
from common import Table, keep_earlier, markdown, progress, shipped_params, timed, working_dir

STUDIES: dict[str, dict[str, Any]] = {
    "default (MLP, synthetic)": {},
    "CNN on digits_images": {"data": {"source": "digits_images"}, "model": {"name": "cnn"}},
    "transformer on sequences": {"data": {"source": "sequences"}, "model": {"name": "transformer"}},
}
# BATCHLAB_BENCH_STUDIES=default,CNN: the studies whose names start with these (the transformer's
# takes ~15 min a rule here: 922 s at load 0.4 on 2026-12-05); BATCHLAB_BENCH_RULES=time: the rules
CHOSEN = os.environ.get("BATCHLAB_BENCH_STUDIES", "").split(",")  # unset: [""], which every name starts with
RUN = {k: v for k, v in STUDIES.items() if any(k.startswith(c) for c in CHOSEN)}
# schedule: the local CBS(t) measured by sweep.local_cbs as a batch warmup (issue #44)
RULES = tuple(os.environ.get("BATCHLAB_BENCH_RULES", "time,statistical,schedule").split(","))


def study_config(overrides: dict[str, Any], rule: str) -> Config:
    merged = {**overrides, "sweep": {"adaptive": True, "local_cbs": rule == "schedule"}, "tracking": {"enabled": False}}
    merged["train"] = {**overrides.get("train", {}), "adapt_rule": rule}
    return shipped_params(merged)


def run_study(cfg: Config, folder: Path) -> tuple[analysis.Study, float]:
    with working_dir(folder):
        paths = Paths(folder)
        stages.generate(cfg, paths)
        _, wall = timed(lambda: run_sweep(cfg, paths))
        rows = [json.loads(p.read_text()) for p in sorted(folder.glob("sweep/experiments/*/result.json"))]
        n_test = json.loads((folder / "data/prepared/dataset.json").read_text())["splits"]["test"]["rows"]
    return analysis.analyse(rows, n_test, cfg.sweep.target_val_loss, cfg.sweep.memory_budget_mb), wall


def _pm(mean: float, half: float, digits: int, star: bool = False) -> str:
    text = f"{mean:.{digits}f} ± {half:.{digits}f}" if half == half else f"{mean:.{digits}f}"
    return text + (" *" if star else "")


def main() -> dict[str, Any]:
    table = Table(
        "sweep.adaptive against the fixed batch sizes (5 seeds, paired by seed; * measurable, Holm over all "
        "comparisons; seconds on the study's clock)",
        ["study", "rule", "adaptive s to target", "fastest fixed (s)", "Δ s vs fastest", "adaptive F1",
         "best F1 (batch)", "Δ F1 vs best", "steps vs best-F1 batch", "not slower / not worse / 40% fewer steps",
         "schedule (seed 0)", "load", "wall (s)", "measured"],
    )  # fmt: skip
    raw: dict[str, Any] = {}
    today = time.strftime("%Y-%m-%d")
    for name, overrides in RUN.items():
        # one folder a study: the fixed rows (keyed without the adaptive rule's settings) and the clock
        # are measured once, so every rule's adaptive row is compared with the same ones, side by side
        with tempfile.TemporaryDirectory() as tmp:
            for rule in RULES:
                progress(f"adaptive: {name}, {rule} rule")
                load = os.getloadavg()[0]
                study, wall = run_study(study_config(overrides, rule), Path(tmp))
                row, figures = verdict_row(study)
                table.add(name, rule, *row[:-1], f"{load:.2f}", f"{wall:.0f}", today)
                progress(f"adaptive: {name}, {rule}: " + " | ".join(row[:-1]))  # a cut-short run keeps its rows
                raw[f"{name} / {rule}"] = {**figures, "load": load, "wall_s": wall, "measured": today}
    order = {name: i for i, name in enumerate(STUDIES)}  # a partial run keeps the other rows
    keep_earlier(
        "adaptive",
        "studies",
        [table],
        raw,
        lambda r: f"{r[0]} / {r[1]}",
        lambda r: (order.get(r[0], len(order)), r[1] != "time"),
    )
    tables = [table.as_dict()]
    print(markdown(tables))
    return {"tables": tables, "studies": raw}


def verdict_row(study: analysis.Study) -> tuple[list[str], dict[str, Any]]:
    assert study.adaptive is not None
    reached = {r["batch_size"]: r["seconds_to_target_mean"] for r in study.rows if r["reached"] == r["seeds"]}
    fastest, best = min(reached, key=lambda b: reached[b]), study.verdict.best
    sec, f1 = study.adaptive.figures["seconds_to_target"], study.adaptive.figures["test_f1_macro"]
    steps = study.adaptive.figures["steps_to_target"][0]
    vs_fast = study.adaptive.against(fastest, "seconds_to_target")
    vs_best = study.adaptive.against(best, "test_f1_macro")
    best_row = next(r for r in study.rows if r["batch_size"] == best)
    fewer = 1 - steps / best_row["steps_to_target_mean"]
    goals = (not (vs_fast.measurable and vs_fast.diff_mean > 0), not (vs_best.measurable and vs_best.diff_mean < 0),
             fewer >= 0.40)  # fmt: skip
    seed0 = min(study.adaptive.results, key=lambda r: r["seed"])
    decisions = seed0["batch_schedule"]
    moves = [str(d["to"]) for d in decisions if d["to"] != d["from"]]
    schedule = " → ".join([str(decisions[0]["from"]), *moves]) if decisions else "—"
    row = [
        f"{_pm(*sec, 3)} ({study.adaptive.reached}/{len(study.adaptive.results)} reached)",
        f"{reached[fastest]:.3f} (batch {fastest})",
        _pm(vs_fast.diff_mean, vs_fast.diff_ci95, 3, vs_fast.measurable),
        _pm(*f1, 4),
        f"{best_row['test_f1_macro_mean']:.4f} ({best})",
        _pm(vs_best.diff_mean, vs_best.diff_ci95, 4, vs_best.measurable),
        f"{steps:.0f} vs {best_row['steps_to_target_mean']:.0f} "
        + (f"({fewer:.0%} fewer)" if fewer >= 0 else f"({-fewer:.0%} more)"),
        " / ".join("met" if g else "not met" for g in goals),
        schedule,
        "",
    ]
    figures = {"adaptive_seconds": sec, "adaptive_f1": f1, "adaptive_steps": steps, "fastest": fastest,
               "fastest_seconds": reached[fastest], "best_f1_batch": best, "fewer_steps": fewer,
               "goals": {"not_slower": goals[0], "not_worse_f1": goals[1], "fewer_steps_40": goals[2]}}  # fmt: skip
    return row, figures


if __name__ == "__main__":
    main()
