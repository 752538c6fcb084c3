"""Test-split metrics of a model, computed with scikit-learn, and the files evaluate writes; the
sweep's accuracy and macro F1 of an experiment, computed with numpy to the same bits.

scikit-learn is imported where it is used: ~1.2 s of the ~3 s start of an experiment's process,
which needs none of it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from batchlab import atomic
from batchlab.data import Dataset
from batchlab.model import load_model


def classification_metrics(
    y_true: np.ndarray, y_pred: np.ndarray, proba: np.ndarray, class_names: list[str]
) -> dict[str, float]:
    """accuracy, precision/recall/F1 (macro, weighted, per class) and ROC-AUC when binary."""
    from sklearn import metrics as skm

    labels = list(range(len(class_names)))
    out: dict[str, float] = {"accuracy": float(skm.accuracy_score(y_true, y_pred))}
    for average in ("macro", "weighted"):
        p, r, f, _ = skm.precision_recall_fscore_support(
            y_true, y_pred, labels=labels, average=average, zero_division=0
        )
        out |= {f"precision_{average}": float(p), f"recall_{average}": float(r), f"f1_{average}": float(f)}
    p, r, f, _ = skm.precision_recall_fscore_support(y_true, y_pred, labels=labels, zero_division=0)
    for i, name in enumerate(class_names):
        key = _safe(name)
        out |= {f"precision_{key}": float(p[i]), f"recall_{key}": float(r[i]), f"f1_{key}": float(f[i])}
    if len(class_names) == 2:
        out["roc_auc"] = float(skm.roc_auc_score(y_true, proba[:, 1]))
    else:
        out["roc_auc_ovr"] = float(skm.roc_auc_score(y_true, proba, multi_class="ovr", labels=labels))
    return out


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def confusion(y_true: np.ndarray, y_pred: np.ndarray, n_classes: int) -> np.ndarray:
    from sklearn import metrics as skm

    return skm.confusion_matrix(y_true, y_pred, labels=list(range(n_classes)))


def save_confusion_png(matrix: np.ndarray, class_names: list[str], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from sklearn import metrics as skm

    size = 3 + 0.4 * len(class_names)
    fig, ax = plt.subplots(figsize=(size, size))
    skm.ConfusionMatrixDisplay(matrix, display_labels=class_names).plot(ax=ax, colorbar=False)
    ax.set_title("Confusion matrix (test split)")
    fig.tight_layout()
    atomic.write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)


def predictions_csv(y_true: np.ndarray, y_pred: np.ndarray, class_names: list[str]) -> str:
    """One row per test example, the shape `dvc plots` confusion templates read."""
    rows = ["actual,predicted"] + [f"{class_names[t]},{class_names[p]}" for t, p in zip(y_true, y_pred, strict=True)]
    return "\n".join(rows) + "\n"


def score_test_split(model_path: Path, dataset: Dataset) -> tuple[dict[str, float], np.ndarray, list[str]]:
    """Test-split metrics of a saved model; also its predictions and class names."""
    model, class_names = load_model(model_path)
    return score_model(model, class_names, dataset)


def score_model(
    model: torch.nn.Module, class_names: list[str], dataset: Dataset
) -> tuple[dict[str, float], np.ndarray, list[str]]:
    """Test-split metrics of a model on the CPU, in eval mode; also its predictions and class names."""
    proba = _test_proba(model, dataset)
    y_pred = proba.argmax(1)
    return classification_metrics(dataset.test.y, y_pred, proba, class_names), y_pred, class_names


def _test_proba(model: torch.nn.Module, dataset: Dataset) -> np.ndarray:
    with torch.no_grad():
        return torch.softmax(model(torch.from_numpy(dataset.test.x)), dim=1).numpy()


def split_accuracy_and_macro_f1(model: torch.nn.Module, dataset: Dataset) -> tuple[float, float]:
    """The model's accuracy and macro F1 on the test split, as `score_model` reports them, without
    scikit-learn."""
    return accuracy_and_macro_f1(dataset.test.y, _test_proba(model, dataset).argmax(1), len(dataset.class_names))


def accuracy_and_macro_f1(y_true: np.ndarray, y_pred: np.ndarray, classes: int) -> tuple[float, float]:
    """Accuracy and macro F1 over classes 0 .. classes-1, a class with no true and no predicted row
    counting 0: scikit-learn's accuracy_score and f1_score(labels=..., average="macro",
    zero_division=0), which `classification_metrics` reports, to the bit
    (tests/inference/test_macro_f1.py)."""
    counts = np.bincount(y_true * classes + y_pred, minlength=classes * classes).reshape(classes, classes)
    tp = np.diag(counts).astype(np.float64)
    denominator = counts.sum(0) + counts.sum(1)  # 2tp + fp + fn
    f1 = np.divide(2 * tp, denominator, out=np.zeros(classes), where=denominator > 0)
    return float(tp.sum() / len(y_true)), float(np.mean(f1))
