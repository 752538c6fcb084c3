"""The default study as committed (`make run`'s reports/sweep/), its verdict recomputed from its
own per-experiment rows with scipy alone: the figures the README and summary.md print."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict

import pytest
from scipy import stats

from batchlab import atomic
from tests.support import REPO

REPORTS = REPO / "reports" / "sweep"


def test_no_batch_size_beats_the_default_studys_recommendation_and_its_price_is_scipys() -> None:
    rows = atomic.read_csv(REPORTS / "experiments.csv")
    f1: dict[int, dict[int, float]] = defaultdict(dict)
    for row in rows:
        f1[int(row["batch_size"])][int(row["seed"])] = float(row["test_f1_macro"])
    batches = sorted(f1)
    assert len(batches) == 6 and {len(by_seed) for by_seed in f1.values()} == {5}  # params.yaml's study
    p = {(a, b): stats.ttest_rel([f1[a][s] for s in range(5)], [f1[b][s] for s in range(5)]).pvalue
         for i, a in enumerate(batches) for b in batches[i + 1 :]}  # fmt: skip
    adjusted, running = {}, 0.0  # Holm by adjusted p-values: max over the running (m − j)·p
    for j, key in enumerate(sorted(p, key=p.__getitem__)):
        running = max(running, min(1.0, (len(p) - j) * p[key]))
        adjusted[key] = running
    mean = {b: statistics.fmean(f1[b].values()) for b in batches}
    beaten_by: dict[int, list[int]] = defaultdict(list)  # lower -> the batch sizes that beat it measurably
    for (a, b), q in sorted(adjusted.items()):
        if q <= 0.05:
            higher, lower = (a, b) if mean[a] > mean[b] else (b, a)
            beaten_by[lower].append(higher)
    figures = json.loads((REPORTS / "sweep.json").read_text())
    chosen, best = figures["recommended_batch_size"], figures["best_f1_batch_size"]
    assert best == max(batches, key=mean.__getitem__)
    assert chosen not in beaten_by, f"batch {chosen} is beaten measurably by {beaten_by[chosen]}"
    # the fastest to the target among the unbeaten
    seconds = {
        int(r["batch_size"]): float(r["seconds_to_target_mean"]) for r in atomic.read_csv(REPORTS / "summary.csv")
    }
    unbeaten = [b for b in batches if b not in beaten_by]
    assert chosen == min(unbeaten, key=seconds.__getitem__)
    text = (REPORTS / "summary.md").read_text()
    first = text.split("## Verdict\n\n", 1)[1].splitlines()[0]
    diffs = [f1[chosen][s] - f1[best][s] for s in range(5)]
    half = stats.t.ppf(0.975, 4) * stats.sem(diffs)
    assert first.startswith(f"Recommended: batch {chosen}, the fastest to the target val loss")
    assert f"{seconds[best] / seconds[chosen]:.1f}x faster to the target than batch {best}" in first
    assert f"at a test F1 {statistics.fmean(diffs):+.4f} ± {half:.4f} against it" in first
    assert figures["recommended_f1_minus_best"] == pytest.approx(statistics.fmean(diffs), rel=1e-9)
    beaten = "; ".join(f"{lo} by {', '.join(map(str, sorted(his)))}" for lo, his in sorted(beaten_by.items()))
    assert f"error): {beaten}. No batch size beats {', '.join(map(str, unbeaten))}: the candidates." in text
