from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import f1_score, precision_score, recall_score

from batchlab import evaluate

Y_TRUE = np.array([0, 0, 1, 1, 1, 2, 2, 2, 2])
Y_PRED = np.array([0, 1, 1, 1, 0, 2, 2, 1, 2])
PROBA = np.eye(3)[Y_PRED] * 0.7 + 0.1


def test_metrics_match_scikit_learn_and_name_every_class() -> None:
    m = evaluate.classification_metrics(Y_TRUE, Y_PRED, PROBA, ["cat", "dog", "bird"])
    assert m["f1_macro"] == pytest.approx(f1_score(Y_TRUE, Y_PRED, average="macro"))
    assert m["precision_weighted"] == pytest.approx(precision_score(Y_TRUE, Y_PRED, average="weighted"))
    assert m["recall_macro"] == pytest.approx(recall_score(Y_TRUE, Y_PRED, average="macro"))
    assert m["accuracy"] == pytest.approx(6 / 9)
    assert m["recall_bird"] == pytest.approx(3 / 4)
    assert "roc_auc_ovr" in m and "roc_auc" not in m


def test_binary_reports_roc_auc() -> None:
    y = np.array([0, 0, 1, 1])
    proba = np.array([[0.9, 0.1], [0.4, 0.6], [0.35, 0.65], [0.2, 0.8]])
    m = evaluate.classification_metrics(y, proba.argmax(1), proba, ["no", "yes"])
    assert m["roc_auc"] == pytest.approx(1.0)


def test_confusion_png_and_plot_rows(tmp_path: Path) -> None:
    matrix = evaluate.confusion(Y_TRUE, Y_PRED, 3)
    assert matrix.tolist() == [[1, 1, 0], [1, 2, 0], [0, 1, 3]]
    evaluate.save_confusion_png(matrix, ["cat", "dog", "bird"], tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = evaluate.predictions_csv(Y_TRUE, Y_PRED, ["cat", "dog", "bird"]).splitlines()
    assert rows[0] == "actual,predicted" and rows[2] == "cat,dog" and len(rows) == 10
