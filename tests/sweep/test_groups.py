"""The sweep decides once whether a batch size's seeds train together, and every experiment's
speed follows that decision (plan.Work.together)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from batchlab import atomic, data
from batchlab.paths import Paths
from batchlab.sweep import executors, groups, probes
from batchlab.sweep.plan import Lane, plan
from tests.support import tiny_config

HERE = "tests.sweep.test_groups"


def batchnorm_mlp(input_shape: tuple[int, ...], n_classes: int, width: int = 16) -> nn.Module:
    """A user's factory model that the config cannot tell apart from one whose seeds train together."""
    return nn.Sequential(
        nn.Linear(input_shape[0], width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, n_classes)
    )


@pytest.mark.integration  # the experiments' runs read git (tracking.environment_tags), even with tracking off
def test_a_batchnorm_factory_sweep_reads_each_experiments_speed_from_its_own_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its seeds train apart (groups.groups tries the model), so each experiment's samples/s is the
    median of its own epochs, as any experiment trained alone: before, the speed step asked the
    config alone, took the seeds for grouped and trained every batch size again for
    probes.solo_speed's fastest window."""
    cfg = tiny_config(model={"factory": f"{HERE}:batchnorm_mlp"}, sweep={"batch_sizes": [16, 32], "seeds": [0, 1]})
    paths = Paths(tmp_path)
    dataset, scaler = data.build(cfg.data)
    data.save(dataset, scaler, paths.data)
    todo = plan(cfg, dataset.train.y.shape[0], dataset)
    work = groups.groups(cfg, todo, paths)
    assert [(len(w), w.together) for w in work] == [(1, False)] * 4

    solo: list[Any] = []
    real = probes.solo_speed
    monkeypatch.setattr(probes, "solo_speed", lambda *a: solo.append(a) or real(*a))
    lane = Lane(cfg, paths)
    results = executors.run_local(lane, work)

    assert not solo, f"probes.solo_speed trained {len(solo)} times for a sweep whose seeds train apart"
    for exp in todo:
        history = atomic.read_csv(lane.folder(exp).reports / "history.csv")
        own = statistics.median(float(row["samples_per_s"]) for row in history)
        assert results[exp.name]["samples_per_s"] == pytest.approx(own, rel=1e-12), exp.name
