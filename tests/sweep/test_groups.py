"""The sweep decides once whether a batch size's seeds train together; every experiment's speed,
together or apart, is the sweep's throughput table's (sweep/speeds.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from batchlab import atomic, data
from batchlab.paths import Paths
from batchlab.sweep import executors, groups, speeds
from batchlab.sweep.plan import plan
from batchlab.sweep.tasks import Lane
from tests.support import seeds_apart, tiny_config

HERE = "tests.sweep.test_groups"


def batchnorm_mlp(input_shape: tuple[int, ...], n_classes: int, width: int = 16) -> nn.Module:
    """A user's factory model that the config cannot tell apart from one whose seeds train together."""
    return nn.Sequential(
        nn.Linear(input_shape[0], width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, n_classes)
    )


@pytest.mark.integration  # the experiments' runs read git (tracking.environment_tags), even with tracking off
def test_a_batchnorm_factory_sweep_reads_each_experiments_speed_from_the_table(tmp_path: Path) -> None:
    """Its seeds train apart (groups.groups tries the model); each experiment's samples/s is the
    throughput table's at its batch size and its seconds its examples at that speed (no noise probe
    for a BatchNorm model), not the median of its own epochs, which another experiment's load moves."""
    cfg = tiny_config(model={"factory": f"{HERE}:batchnorm_mlp"}, sweep={"batch_sizes": [16, 32], "seeds": [0, 1]})
    paths = Paths(tmp_path)
    dataset, scaler = data.build(cfg.data)
    data.save(dataset, scaler, paths.data)
    todo = plan(cfg, dataset.train.y.shape[0], dataset)
    work = groups.groups(cfg, todo, seeds_apart(cfg, paths))
    assert [len(w) for w in work] == [1] * 4

    clock = speeds.clock_work(cfg, paths, todo, dataset)
    assert clock is not None
    executors.run_local(Lane(cfg, paths), [clock])  # the sweep's first task
    table = speeds.stored(cfg, paths)
    assert table is not None and table.probe is not None  # the table times the probe when train.gns is on
    lane = Lane(cfg, paths, None, table)
    results = executors.run_local(lane, work)

    for exp in todo:
        row = results[exp.name]
        history = atomic.read_csv(lane.folder(exp).reports / "history.csv")
        assert "gns.probes" not in history[0]  # BatchNorm: no noise probe, none counted
        assert row["samples_per_s"] == table.samples_per_s(exp.batch_size), exp.name
        expected = [examples / row["samples_per_s"] for examples in row["epoch_examples"]]
        assert row["epoch_train_seconds"] == pytest.approx(expected, rel=1e-12), exp.name
    # stored: a resumed sweep times nothing and reads the same clock
    assert speeds.clock_work(cfg, paths, todo, dataset) is None and speeds.stored(cfg, paths) == table
