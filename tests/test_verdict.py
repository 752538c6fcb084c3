"""The verdict never calls a difference inside the noise "best"."""

from __future__ import annotations

import math

import pytest

from batchlab.study import verdict


def test_mean_ci_uses_students_t() -> None:
    mean, half = verdict.mean_ci([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.302653 * 1.0 / math.sqrt(3), rel=1e-5)
    assert math.isnan(verdict.mean_ci([1.0])[1])


def test_indistinguishable_results_are_called_so_and_the_fastest_is_recommended() -> None:
    # batch 32 is ahead by one test example on two seeds and behind on the third: noise
    f1 = {16: {0: 0.964, 1: 0.962, 2: 0.966}, 32: {0: 0.966, 1: 0.964, 2: 0.963}, 64: {0: 0.963, 1: 0.964, 2: 0.965}}
    result = verdict.decide(f1, {16: 3.0, 32: 1.5, 64: 0.9}, {16: 1e4, 32: 2e4, 64: 4e4}, n_test=600)
    assert result.best == 32 and result.tied == [16, 32, 64]
    assert result.recommended == 64  # the fastest to the target among those that cannot be told apart
    assert "No batch size is measurably worse" in result.text and "600 rows" in result.text


def test_consistently_worse_batch_is_excluded_from_the_recommendation() -> None:
    f1 = {16: {0: 0.96, 1: 0.961, 2: 0.962}, 512: {0: 0.90, 1: 0.905, 2: 0.899}}
    result = verdict.decide(f1, {16: 5.0, 512: 0.5}, {16: 1e4, 512: 9e4}, n_test=600)
    assert result.tied == [16] and result.recommended == 16
    assert "Measurably worse: 512" in result.text


def test_one_seed_says_no_ranking_can_be_trusted() -> None:
    result = verdict.decide({16: {0: 0.96}, 32: {0: 0.97}}, {16: 2.0, 32: None}, {16: 1e4, 32: 2e4}, n_test=600)
    assert "no difference can be told from noise" in result.text
    assert result.recommended == 16  # 32 never reached the target
