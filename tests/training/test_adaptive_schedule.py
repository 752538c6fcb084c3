"""The schedule rule (train.adapt_rule: schedule): the batch follows train.adapt_schedule, the
measured local CBS(t) as a batch warmup, without reading the noise scale; the study's CBS(t) turns
into that schedule."""

from __future__ import annotations

import math

import pytest
import torch

from batchlab.config import ConfigError
from batchlab.data import Dataset
from batchlab.study import local_cbs
from batchlab.training.adaptive import BatchSchedule
from batchlab.training.optim import scaled_lr
from batchlab.training.strategy import Strategy
from batchlab.training.train import fit
from tests.support import tiny_config

PLAN = ((0.0, 16), (0.25, 64), (0.5, 100), (0.75, 1000))


def test_each_decision_takes_the_largest_reachable_batch_up_to_the_plans() -> None:
    """16 doubles to 64 at a quarter of the run at once; 100 is not reachable by doubling from 64, so
    64 holds; the cap (256) stops 1000. The lr follows the sqrt rule over each change."""
    schedule = BatchSchedule(16, 256, 100, 0.05, 1, "sqrt", "schedule", plan=PLAN, total=1000)
    seen = []
    for examples in (0, 100, 249, 250, 499, 500, 749, 750, 900):
        before = schedule.batch
        factor = schedule.decide(examples // 16, examples, math.nan)
        seen.append(schedule.batch)
        assert factor == (scaled_lr(1.0, before, schedule.batch, "sqrt") if schedule.batch != before else None)
    assert seen == [16, 16, 16, 64, 64, 64, 64, 256, 256]
    assert schedule.summary() == "16 -> 64 (step 15) -> 256 (step 46)"
    assert "adapt_schedule's batch at 75% of the run's examples is 1000" in schedule.decisions[7]["reason"]


def test_a_schedule_below_the_batch_holds_it_and_a_rounded_share_is_not_missed() -> None:
    """A run that starts above the plan's batch holds (the batch never shrinks); a share kept to six
    places (2/3 -> 0.666667) applies at the epoch's end it stands for."""
    above = BatchSchedule(64, 512, 100, 0.05, 1, "sqrt", "schedule", plan=((0.0, 16), (0.5, 32)), total=900)
    assert above.decide(1, 0, math.nan) is None and above.decide(8, 500, math.nan) is None and above.batch == 64
    rounded = BatchSchedule(16, 512, 100, 0.05, 1, "sqrt", "schedule", plan=((round(2 / 3, 6), 64),), total=300)
    rounded.decide(13, 200, math.nan)
    assert rounded.batch == 64


def test_a_training_follows_its_schedule_without_the_noise_probe(tiny_dataset: Dataset) -> None:
    """train.gns off: the schedule rule reads nothing. Decisions fall at each epoch's end; the batch
    of each epoch is the plan's at the examples seen before it."""
    n = tiny_dataset.train.y.shape[0]
    plan = [[0.0, 16], [0.5, 64]]
    cfg = tiny_config(train={"epochs": 4, "batch_size": 16, "gns": False, "adaptive_batch": True,
                             "adapt_rule": "schedule", "adapt_schedule": plan})  # fmt: skip
    result = fit(cfg, tiny_dataset, Strategy(torch.device("cpu")))
    for d in result.batch_schedule:
        target = max(b for s, b in plan if s <= d["examples"] / (4 * n))
        assert d["to"] == target and not math.isfinite(d["b_noise"]), d
    assert [row["batch_size"] for row in result.history] == [16, 16, 64, 64]
    assert not any(key.startswith("gns.") for key in result.history[-1])  # no probe was taken


def test_the_schedule_rule_without_a_schedule_is_one_line(tiny_dataset: Dataset) -> None:
    cfg = tiny_config(train={"adaptive_batch": True, "adapt_rule": "schedule"})
    with pytest.raises(ConfigError, match=r"^train.adapt_rule schedule needs train.adapt_schedule: \[\[share"):
        fit(cfg, tiny_dataset, Strategy(torch.device("cpu")))


@pytest.mark.parametrize(
    ("schedule", "says"),
    [
        ([[0.5, 64], [0.25, 128]], "train.adapt_schedule must rise"),
        ([[0.25, 128], [0.5, 64]], "train.adapt_schedule must rise"),
        ([[1.0, 64]], "train.adapt_schedule"),
        ([[0.5, 0]], "train.adapt_schedule"),
    ],
)
def test_a_bad_schedule_is_one_line_naming_the_key(schedule: list, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        tiny_config(train={"adaptive_batch": True, "adapt_rule": "schedule", "adapt_schedule": schedule})
    assert says in str(err.value) and "\n" not in str(err.value)


def _point(fraction: float, multiplier: int, measured: bool = True) -> local_cbs.Point:
    ks = [1, 2, 4, 8]
    fake = local_cbs.Estimate(multiplier, 1, 8, ks, [0.0] * 4, [math.nan] * 4, [math.nan] * 4, [False] * 4,
                              [True] * 4, 0.1 if measured else -0.1, measured)  # fmt: skip
    return local_cbs.Point(1, fraction, 0, 32, [1.0], [[1.0] * 4], math.nan, math.nan, fake)


def test_cbs_t_becomes_a_rising_schedule_of_its_estimates() -> None:
    """Each measured point's CBS from its share on, never below an earlier point's; a point the base
    branch made no progress at says nothing."""
    points = [_point(0.5, 2), _point(0.1, 1), _point(0.25, 4), _point(0.75, 8, measured=False)]
    assert local_cbs.schedule(points) == [(0.1, 32), (0.25, 128), (0.5, 128)]
    assert "`train.adapt_schedule: [[0.1, 32], [0.25, 128], [0.5, 128]]`" in local_cbs.section(points, 0.1, None)
