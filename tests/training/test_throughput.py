"""The throughput table: its figures against what is known (a fitted line through exact points, the
median's interval's coverage in simulation), and its ranking under load that starts part-way."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from scipy import stats

from batchlab.study.verdict import decide
from batchlab.training import throughput
from batchlab.training.throughput import Entry, Table, fit_step_time
from tests.support import tiny_config


def test_the_step_time_fit_recovers_a_line_and_stays_non_negative() -> None:
    a, b = 4e-4, 2e-6
    points = [(batch, a + b * batch) for batch in (16, 32, 64, 128, 256, 512)]
    assert fit_step_time(points) == pytest.approx((a, b), rel=1e-9)
    # the same line, each point off by a relative error: weighted, the small batches count as much
    noisy = [(batch, t * f) for (batch, t), f in zip(points, (1.02, 0.98, 1.01, 0.99, 1.02, 0.98), strict=True)]
    fitted = fit_step_time(noisy)
    assert fitted[0] == pytest.approx(a, rel=0.1) and fitted[1] == pytest.approx(b, rel=0.1)
    assert fit_step_time([(16, 1e-3), (512, 1e-3)]) == (pytest.approx(1e-3), 0.0)  # flat: all fixed cost
    assert fit_step_time([(16, 1e-4), (512, 4e-3)])[0] == 0.0  # through the origin, never a negative intercept


def test_the_medians_interval_covers_at_its_stated_level() -> None:
    """9 rounds: the 2nd to 8th order statistics cover the median with 1 - 2 P(Bin(9, 1/2) <= 1) =
    96.1%. Simulated on a skewed distribution (a busy machine's slow windows), 20,000 times."""
    level = 1 - 2 * stats.binom.cdf(throughput.INTERVAL_RANK - 1, throughput.ROUNDS, 0.5)
    assert level == pytest.approx(0.9609, abs=1e-4)
    rng = np.random.default_rng(0)
    true_median = 1e-3 * (1 + math.log(2))  # of 1 ms + an exponential delay of mean 1 ms
    hits = 0
    trials = 20_000
    for draw in 1e-3 * (1 + rng.exponential(1.0, size=(trials, throughput.ROUNDS))):
        low, high = Entry(64, 10, draw.tolist()).interval
        hits += low <= true_median <= high
    assert abs(hits / trials - level) < 4 * math.sqrt(level * (1 - level) / trials)


def test_the_table_reads_its_medians_and_the_fit_between_them() -> None:
    entries = [Entry(16, 5, [1e-3, 3e-3, 2e-3]), Entry(64, 5, [2e-3, 2e-3, 9e-3])]
    table = Table("k", entries, Entry(0, 1, [5e-3]), (0.1, 0, 0), (0.2, 0, 0), 2, 1, "m", 1.0, (1e-3, 1e-5))
    assert table.samples_per_s(16) == pytest.approx(16 / 2e-3) and table.samples_per_s(64) == pytest.approx(32_000)
    assert table.step_seconds(32) == pytest.approx(1e-3 + 32e-5)  # not timed: the fit
    assert table.probe_seconds == 5e-3
    again = Table.from_dict(table.to_dict())
    assert again == table
    assert table.to_dict()["rows"][0]["samples_per_s_low"] == pytest.approx(16 / 3e-3)


def _busy(cores: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]


@pytest.mark.integration  # starts busy processes
def test_load_that_starts_part_way_through_the_block_moves_neither_the_ranking_nor_the_recommendation() -> None:
    """A busy process on every core starts a third of the way through the block: every batch size
    is slowed alike from then on (round robin), so the ranking and the batch a study would recommend
    stay as on a quiet machine. Timed one batch size after another instead, the ones timed late
    would be slowed alone."""
    cfg = tiny_config()
    from batchlab.data import build

    dataset, _ = build(cfg.data)
    sizes = [16, 64, 256]
    torch.set_num_threads(1)
    quiet = throughput.measure(cfg, dataset, sizes, "quiet")
    busy: list[subprocess.Popen[bytes]] = []
    timer = threading.Timer(quiet.seconds / 3, lambda: busy.extend(_busy(6)))
    timer.start()
    try:
        loaded = throughput.measure(cfg, dataset, sizes, "loaded")
    finally:
        timer.cancel()
        time.sleep(0.1)
        for p in busy:
            p.kill()
            p.wait()
    assert busy, "the busy processes started after the block had ended: lengthen the block"

    def ranking(table: Table) -> list[int]:
        return sorted(sizes, key=table.samples_per_s)

    assert ranking(loaded) == ranking(quiet), (quiet.to_dict()["rows"], loaded.to_dict()["rows"])
    # a study on McCandlish's steps S(B) = S_min (1 + B_noise / B), every F1 equal: the fastest to
    # the target is recommended, on the table's seconds per step. B_noise: the one of a few whose
    # quiet answer wins by the widest margin (a near tie would be decided by noise, load or not)
    f1 = {b: {s: 0.9 for s in range(3)} for b in sizes}

    def seconds(table: Table, b_noise: float) -> dict[int, float]:
        return {b: 40 * (1 + b_noise / b) * table.step_seconds(b) for b in sizes}

    def margin(b_noise: float) -> float:
        first, second = sorted(seconds(quiet, b_noise).values())[:2]
        return second / first

    b_noise = max((4, 16, 64, 256, 1024), key=margin)
    assert margin(b_noise) > 1.15, [margin(b) for b in (4, 16, 64, 256, 1024)]
    chosen = [decide(f1, seconds(t, b_noise), {b: t.samples_per_s(b) for b in sizes}, 600).recommended
              for t in (quiet, loaded)]  # fmt: skip
    assert chosen[1] == chosen[0], (b_noise, seconds(quiet, b_noise), seconds(loaded, b_noise))
