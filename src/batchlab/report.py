"""The batch-size trade-off report: a table (CSV and Markdown), a recommendation and plots."""

from __future__ import annotations

import csv
import io
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from batchlab import atomic

# what each experiment records, in the order the table shows it
FIGURES = (
    "test_f1_macro",
    "test_accuracy",
    "samples_per_s",
    "epoch_seconds",
    "peak_memory_mb",
    "grad_norm_mean",
    "grad_norm_var",
    "epoch_to_95pct_val_accuracy",
    "overhead_seconds",
)
F1_TOLERANCE = 0.01  # "within 1 point of the best F1"


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def aggregate(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per batch size: mean and std across seeds of every recorded figure."""
    by_batch: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        by_batch[r["batch_size"]].append(r)
    rows = []
    for batch, runs in sorted(by_batch.items()):
        row: dict[str, Any] = {"batch_size": batch, "lr": runs[0]["lr"], "seeds": len(runs)}
        for key in FIGURES:
            values = [float(r[key]) for r in runs]
            row[f"{key}_mean"] = statistics.fmean(values)
            row[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
        rows.append(row)
    return rows


def recommend(rows: list[dict[str, Any]]) -> dict[str, int]:
    best = max(rows, key=lambda r: r["test_f1_macro_mean"])
    close = [r for r in rows if r["test_f1_macro_mean"] >= best["test_f1_macro_mean"] - F1_TOLERANCE]
    fastest = max(close, key=lambda r: r["samples_per_s_mean"])
    return {"best_f1_batch_size": best["batch_size"], "fastest_within_1pt_batch_size": fastest["batch_size"]}


def to_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def _cell(row: dict[str, Any], key: str, digits: int) -> str:
    mean, std = row[f"{key}_mean"], row[f"{key}_std"]
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if row["seeds"] > 1 else f"{mean:.{digits}f}"


def to_markdown(rows: list[dict[str, Any]], pick: dict[str, int]) -> str:
    header = (
        "| batch | lr | test F1 (macro) | test acc | samples/s | s/epoch | peak MB | grad-norm mean | "
        "grad-norm var | epoch to 95% val acc |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r['batch_size']} | {r['lr']:.4g} | {_cell(r, 'test_f1_macro', 4)} | {_cell(r, 'test_accuracy', 4)} | "
        f"{_cell(r, 'samples_per_s', 0)} | {_cell(r, 'epoch_seconds', 3)} | {_cell(r, 'peak_memory_mb', 0)} | "
        f"{_cell(r, 'grad_norm_mean', 3)} | {_cell(r, 'grad_norm_var', 4)} | "
        f"{_cell(r, 'epoch_to_95pct_val_accuracy', 1)} |"
        for r in rows
    ]
    verdict = (
        f"\nBest F1: batch {pick['best_f1_batch_size']}. Fastest within 1 point of that F1: "
        f"batch {pick['fastest_within_1pt_batch_size']}.\n"
    )
    return header + "\n".join(lines) + "\n" + verdict


def plot(rows: list[dict[str, Any]], results: list[dict[str, Any]], folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [r["batch_size"] for r in rows]
    for key, label, name in (
        ("test_f1_macro", "test F1 (macro)", "f1_vs_batch.png"),
        ("samples_per_s", "samples / s", "throughput_vs_batch.png"),
        ("peak_memory_mb", "peak memory (MB)", "memory_vs_batch.png"),
    ):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        means = [r[f"{key}_mean"] for r in rows]
        ax.errorbar(batches, means, yerr=[r[f"{key}_std"] for r in rows], marker="o", capsize=3)
        ax.set(xscale="log", xlabel="batch size", ylabel=label, title=f"{label} vs batch size")
        ax.set_xticks(batches, [str(b) for b in batches])
        fig.tight_layout()
        _save(fig, folder / name)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        curve = r["val_loss_curve"]
        ax.plot(range(1, len(curve) + 1), curve, label=r["name"])
    ax.set(xlabel="epoch", ylabel="val loss", title="Validation loss by batch size")
    ax.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, folder / "val_loss_curves.png")


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    atomic.write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)


def write(results: list[dict[str, Any]], folder: Path) -> dict[str, Any]:
    """Write summary.csv, summary.md, curves.csv and the PNGs into `folder`; return the summary."""
    rows = aggregate(results)
    pick = recommend(rows)
    markdown = to_markdown(rows, pick)
    atomic.write_text(folder / "summary.csv", to_csv(rows))
    atomic.write_text(folder / "summary.md", "# Batch-size sweep\n\n" + markdown)
    curves = [
        {"name": r["name"], "batch_size": r["batch_size"], "epoch": i + 1, "val_loss": v}
        for r in results
        for i, v in enumerate(r["val_loss_curve"])
    ]
    atomic.write_text(folder / "curves.csv", to_csv(curves))
    plot(rows, results, folder)
    return {**pick, "markdown": markdown, "rows": len(rows)}
