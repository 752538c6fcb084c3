"""The sweep's accuracy and macro F1 of an experiment (numpy: its process does not import
scikit-learn) against scikit-learn's, which `batchlab evaluate` reports."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import accuracy_score, f1_score

from batchlab.evaluate import accuracy_and_macro_f1


def _sklearn(y_true: np.ndarray, y_pred: np.ndarray, classes: int) -> tuple[float, float]:
    labels = list(range(classes))
    f1 = f1_score(y_true, y_pred, labels=labels, average="macro", zero_division=0)
    return float(accuracy_score(y_true, y_pred)), float(f1)


@pytest.mark.parametrize("classes", [2, 3, 5, 10])
def test_equal_to_scikit_learns_to_the_bit_on_random_predictions(classes: int) -> None:
    rng = np.random.default_rng(classes)
    for _ in range(200):
        rows = int(rng.integers(1, 60))
        y_true = rng.integers(0, classes, rows)
        # often right, sometimes one class never predicted or never true
        y_pred = np.where(rng.random(rows) < rng.random(), y_true, rng.integers(0, classes, rows))
        if rng.random() < 0.3:
            y_pred[y_pred == classes - 1] = 0
        assert accuracy_and_macro_f1(y_true, y_pred, classes) == _sklearn(y_true, y_pred, classes)


def test_a_class_neither_true_nor_predicted_counts_as_zero_in_the_mean() -> None:
    y_true, y_pred = np.array([0, 0, 1, 1]), np.array([0, 0, 1, 1])
    assert accuracy_and_macro_f1(y_true, y_pred, 3) == _sklearn(y_true, y_pred, 3) == (1.0, 2 / 3)
