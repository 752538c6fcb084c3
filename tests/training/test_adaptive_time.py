"""The time rule (train.adapt_rule: time) against brute force on a simulated run whose noise scale
and step time are known, and in a real training: each decision the rule's on the reading it had."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from batchlab.data import Dataset
from batchlab.training.adaptive import BatchSchedule, lower_bound, seconds_to_loss, time_optimum
from batchlab.training.strategy import Strategy
from batchlab.training.train import fit
from tests.support import tiny_config

A, B = 2e-4, 1e-6  # seconds per step = A + B x batch: the default problem's fit on this CPU, rounded
TABLE = [16, 32, 64, 128, 256, 512, 1024, 2048]


def test_the_closed_form_optimum_is_the_minimum_of_steps_times_step_time() -> None:
    for b_noise in (10.0, 300.0, 5000.0):
        grid = [x / 10 for x in range(10, 200_000)]
        brute = min(grid, key=lambda batch: seconds_to_loss(batch, b_noise, (A, B)))
        assert time_optimum(b_noise, (A, B)) == pytest.approx(brute, rel=2e-3, abs=0.1)


def _b_noise(progress: float) -> float:
    """A noise scale that rises 150x over a run, as the default study's exact value does."""
    return 20 * math.exp(5 * progress)


def _simulate(schedule: BatchSchedule | None, batch: int, every: int = 2800) -> tuple[float, int, list[int]]:
    """McCandlish's model stepped: each step at batch b advances the progress by 1 / (S_min (1 +
    B_noise / b)) and costs t(b) = A + B b; the run ends at progress 1. An adaptive schedule decides
    every `every` examples on the exact B_noise there. Returns (seconds, steps, the batch sizes it chose)."""
    s_min, progress, seconds, steps, examples, chosen = 400, 0.0, 0.0, 0, 0, []
    while progress < 1:
        b = schedule.batch if schedule is not None else batch
        progress += 1 / (s_min * (1 + _b_noise(progress) / b))
        seconds, steps, examples = seconds + A + B * b, steps + 1, examples + b
        if schedule is not None and schedule.due(steps):
            options = [b * 2**k for k in range(8) if b * 2**k <= schedule.cap]
            brute = min(options, key=lambda x: (1 + _b_noise(progress) / x) * (A + B * x))
            schedule.decide(steps, examples, _b_noise(progress))
            assert schedule.batch == brute or (
                1 - seconds_to_loss(brute, _b_noise(progress), (A, B)) / seconds_to_loss(b, _b_noise(progress), (A, B))
                <= schedule.threshold
            ), (steps, b, brute, schedule.batch)
            chosen.append(schedule.batch)
    return seconds, steps, chosen


def test_on_a_simulated_run_the_rule_picks_the_brute_force_optimum_and_beats_every_fixed_batch() -> None:
    """Every decision is the best of the batches it can move to (brute force over the table's sizes,
    unless it saves no more than the threshold), and the run reaches the end sooner than any fixed
    batch size of the table, in seconds, with fewer steps than the fastest fixed one's."""
    fixed = {b: _simulate(None, b)[:2] for b in TABLE}
    schedule = BatchSchedule(16, 2048, 2800, 0.05, 1, "sqrt", "time", (A, B))
    seconds, steps, chosen = _simulate(schedule, 16)
    fastest = min(fixed, key=lambda b: fixed[b][0])
    assert chosen == sorted(chosen) and chosen[-1] > 16  # it grew, and never shrank
    assert seconds < min(s for s, _ in fixed.values()), (seconds, fixed)
    assert steps < fixed[fastest][1]


def test_a_reading_whose_lower_bound_does_not_clear_the_threshold_holds_the_batch() -> None:
    """At B_noise = 2000 the rule would move 64 -> 512; with a standard error as large as the reading
    its lower bound is ~390, where the move saves less, and with one 3x larger it holds."""
    sure = BatchSchedule(64, 4096, 640, 0.05, 1, "sqrt", "time", (A, B))
    sure.decide(10, 640, 2000.0, 50.0)
    assert sure.batch == 512
    unsure = BatchSchedule(64, 4096, 640, 0.05, 1, "sqrt", "time", (A, B))
    unsure.decide(10, 640, 2000.0, 6000.0)
    low = lower_bound(2000.0, 6000.0)
    assert low < 64 and unsure.batch == 64 and "hold" in unsure.decisions[-1]["reason"]
    assert unsure.decisions[-1]["optimum"] == pytest.approx(math.sqrt(A * 2000 / B))


def test_a_time_rule_training_decides_on_examples_and_each_decision_is_the_rules(tiny_dataset: Dataset) -> None:
    """Decisions every 160 examples whatever the batch (10 steps at 16, 5 at 32, ...), each the
    brute-force best at its reading's lower bound, the lr rescaled at each change."""
    cfg = tiny_config(train={"epochs": 6, "batch_size": 16, "adaptive_batch": True, "adapt_every_examples": 160,
                             "adapt_step_time": [A, B]})  # fmt: skip
    result = fit(cfg, tiny_dataset, Strategy(torch.device("cpu")))
    decisions = result.batch_schedule
    assert any(d["to"] > d["from"] for d in decisions)
    for before, after in itertools.pairwise(decisions):
        assert after["step"] - before["step"] == math.ceil(160 / before["to"])  # on examples, not steps
    cap = tiny_dataset.train.y.shape[0]
    for d in decisions:
        if not math.isfinite(d["b_noise"]):
            continue
        options = [d["from"] * 2**k for k in range(12) if d["from"] * 2**k <= cap]
        best = min(options, key=lambda x: seconds_to_loss(x, d["b_noise_low"], (A, B)))
        saves = 1 - seconds_to_loss(best, d["b_noise_low"], (A, B)) / seconds_to_loss(
            d["from"], d["b_noise_low"], (A, B)
        )
        assert d["to"] == (best if saves > 0.05 else d["from"]), d


def test_decisions_are_spaced_so_their_probes_cost_at_most_a_fifth_of_the_steps_between_them() -> None:
    """A probe of 16.5 ms (the default problem's) against steps of A + B x batch: at batch 256 a
    decision every epoch (10 steps) would spend 3.5x the steps' time probing."""
    probe = 0.0165
    schedule = BatchSchedule(256, 4096, 2800, 0.05, 1, "sqrt", "time", (A, B, probe))
    steps = schedule.period()
    assert steps == math.ceil(probe / (0.2 * (A + B * 256))) and steps * 256 > 2800
    assert probe <= 0.2 * steps * (A + B * 256) + 1e-12
    cheap = BatchSchedule(256, 4096, 2800, 0.05, 1, "sqrt", "time", (A, B, 1e-5))
    assert cheap.period() == math.ceil(2800 / 256)  # a cheap probe: train.adapt_every_examples decides
    assert BatchSchedule(256, 4096, 2800, 0.05, 1, "sqrt", "statistical", (A, B, probe)).period() == 11


def test_the_time_rule_picks_its_starting_batch_from_a_reading_of_the_initial_weights(tiny_dataset: Dataset) -> None:
    cfg = tiny_config(train={"epochs": 2, "batch_size": 8, "adaptive_batch": True, "adapt_step_time": [A, B]})
    result = fit(cfg, tiny_dataset, Strategy(torch.device("cpu")))
    first = result.batch_schedule[0]
    assert (first["step"], first["examples"], first["from"]) == (0, 0, 8) and math.isfinite(first["b_noise"])
    options = [8 * 2**k for k in range(12) if 8 * 2**k <= tiny_dataset.train.y.shape[0]]
    best = min(options, key=lambda x: seconds_to_loss(x, first["b_noise_low"], (A, B)))
    assert first["to"] == best > 8, first
    assert result.history[0]["gns.probes"] >= 1  # the first reading counts as a probe (the study's clock)
