"""The batch-size study's PNGs: figures against batch size, steps against examples, val curves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchlab import atomic
from batchlab.study import critical
from batchlab.study.analysis import Study


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _batch_axis(ax: Any, batches: list[int]) -> None:
    """Log-scale batch axis labelled with the batch sizes only: the default minor-tick labels
    (2×10¹, 3×10¹, ...) print on top of 16…512."""
    from matplotlib.ticker import NullFormatter, NullLocator

    ax.set_xscale("log")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())


def _save(fig: Any, path: Path) -> None:
    plt = _pyplot()
    atomic.write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)


def against_batch(study: Study, folder: Path) -> None:
    plt = _pyplot()
    batches = [r["batch_size"] for r in study.rows]
    for key, label, name in (
        ("test_f1_macro", "test F1 (macro)", "f1_vs_batch.png"),
        ("samples_per_s", "throughput (samples/s)", "throughput_vs_batch.png"),
        ("step_memory_mib", "step tensor memory (MiB)", "memory_vs_batch.png"),
    ):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        means = [r[f"{key}_mean"] for r in study.rows]
        halves = [r[f"{key}_ci95"] for r in study.rows]
        errors = [h if h == h else 0.0 for h in halves]  # NaN: one measurement, no interval
        ax.errorbar(batches, means, yerr=errors, marker="o", capsize=3)
        shown = "95% CI" if any(h == h for h in halves) else "one measurement per batch size"
        ax.set(xlabel="batch size", ylabel=label, title=f"{label} vs batch size ({shown})")
        _batch_axis(ax, batches)
        fig.tight_layout()
        _save(fig, folder / name)


def steps_vs_examples(study: Study, folder: Path) -> None:
    """Each experiment's (examples, steps) to the target, the batch means labelled, the fitted
    hyperbola and its two regimes."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    done = [r for r in study.results if r["steps_to_target"] is not None]
    ax.scatter([r["examples_to_target"] for r in done], [r["steps_to_target"] for r in done], s=12, alpha=0.4)
    for row in study.rows:
        if row["reached"]:
            e, s = row["examples_to_target_mean"], row["steps_to_target_mean"]
            ax.plot(e, s, "o", color="C0")
            ax.annotate(f"B={row['batch_size']}", (e, s), textcoords="offset points", xytext=(5, 4), fontsize=8)
    fit = study.fit
    if isinstance(fit, critical.Fit):
        lo, hi = min(r["batch_size"] for r in study.rows) / 4, max(r["batch_size"] for r in study.rows) * 4
        grid = [lo * (hi / lo) ** (i / 199) for i in range(200)]
        ax.plot(
            [fit.steps_at(b) * b for b in grid],
            [fit.steps_at(b) for b in grid],
            "--",
            color="C1",
            label=f"(S/S_min−1)(E/E_min−1)=1, B_crit={fit.b_crit:.0f}, R²={fit.r2:.2f}",
        )
        ax.axhline(fit.s_min, color="grey", lw=0.8, ls=":")
        ax.axvline(fit.e_min, color="grey", lw=0.8, ls=":")
        ax.plot(2 * fit.e_min, 2 * fit.s_min, "x", color="C1", label=f"B = B_crit ({fit.b_crit:.0f})")
        ax.text(0.06, 0.93, "perfect scaling (B < B_crit): E ≈ E_min", transform=ax.transAxes, fontsize=8)
        ax.text(
            0.97, 0.1, "diminishing returns (B > B_crit): S ≈ S_min", transform=ax.transAxes, fontsize=8, ha="right"
        )
        ax.legend(fontsize=7, loc="upper right", bbox_to_anchor=(1.0, 0.88))
    adapted = [r for r in (study.adaptive.results if study.adaptive else []) if r["steps_to_target"] is not None]
    if adapted:  # sweep.adaptive: each seed's point, where no fixed batch size sits
        ax.plot([r["examples_to_target"] for r in adapted], [r["steps_to_target"] for r in adapted], "D",
                color="C3", ms=5, label="adaptive (each seed)")  # fmt: skip
        ax.legend(fontsize=7, loc="upper right", bbox_to_anchor=(1.0, 0.88))
    if not done:
        ax.text(0.5, 0.5, "no experiment reached the target", transform=ax.transAxes, ha="center")
    ax.set(
        xscale="log" if done else "linear",
        yscale="log" if done else "linear",
        xlabel="examples to target (E)",
        ylabel="optimizer steps to target (S)",
        title=f"Steps vs examples to val loss ≤ {study.target:.3f}",
    )
    fig.tight_layout()
    _save(fig, folder / "steps_vs_examples.png")


def val_curves(study: Study, folder: Path) -> None:
    """Each batch size's val loss against examples seen: the mean over seeds, with its 95% band
    (analysis.seed_bands; MLflow's UI draws one line per run and no band)."""
    from batchlab.study.analysis import seed_bands

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    seeds = len({r["seed"] for r in study.results})
    for i, band in enumerate(seed_bands(study.results)):
        colour = f"C{i % 10}"
        ax.plot(band.examples, band.mean, color=colour, lw=0.9, label=f"batch {band.batch_size}")
        ax.fill_between(band.examples, band.low, band.high, color=colour, alpha=0.2, lw=0)
    ax.axhline(study.target, color="black", lw=0.8, ls="--", label="target")
    title = f"Validation loss: mean and 95% band over {seeds} seeds" if seeds > 1 else "Validation loss (one seed)"
    ax.set(xscale="log", xlabel="examples seen", ylabel="val loss", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, folder / "val_loss_curves.png")


def noise_scale_curves(study: Study, folder: Path) -> None:
    """The measured B_simple over training, against examples seen: each batch size's mean over its
    seeds at each scored step where any seed has a reading, the target's crossing marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    drawn = False
    for i, batch in enumerate(sorted(study.lr_choice)):
        runs = [r for r in study.results if r["batch_size"] == batch]
        by_step: dict[int, list[float]] = {}
        for r in runs:
            for step, value in zip(r["curve_steps"], r["curve_b_simple"], strict=True):
                if value == value and value > 0:  # a reading: finite and positive
                    by_step.setdefault(step, []).append(value)
        if not by_step:
            continue
        steps = sorted(by_step)
        ax.plot([s * batch for s in steps], [sum(by_step[s]) / len(by_step[s]) for s in steps],
                color=f"C{i % 10}", lw=0.9, label=f"batch {batch}")  # fmt: skip
        reached = [r["examples_to_target"] for r in runs if r.get("examples_to_target") is not None]
        if reached:
            ax.axvline(sum(reached) / len(reached), color=f"C{i % 10}", lw=0.6, ls=":")
        drawn = True
    drawn = _adaptive_schedule(ax, study) or drawn
    if drawn:
        from matplotlib.ticker import NullFormatter

        ax.set(xscale="log", yscale="log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # 2×10³, 3×10³, ... print over each other
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no noise-scale readings", transform=ax.transAxes, ha="center")
    ax.set(xlabel="examples seen", ylabel="B_simple (measured)",
           title="Gradient noise scale over training (dotted: the target reached)")  # fmt: skip
    fig.tight_layout()
    _save(fig, folder / "noise_scale_curves.png")


def _adaptive_schedule(ax: Any, study: Study) -> bool:
    """sweep.adaptive: each seed's batch over training (a step line) and the readings it decided
    on, beside the fixed sizes' noise scale: both are examples per step."""
    if study.adaptive is None:
        return False
    for i, r in enumerate(study.adaptive.results):
        decisions = r.get("batch_schedule") or []
        if not decisions:
            continue
        label = "adaptive: batch" if i == 0 else None
        examples = [decisions[0]["examples"]] + [d["examples"] for d in decisions]  # from its first decision
        batches = [decisions[0]["from"]] + [d["to"] for d in decisions]
        ax.step(examples, batches, where="post", color="black", lw=1.2, label=label)
        read = [(d["examples"], d["b_noise"]) for d in decisions if d["b_noise"] == d["b_noise"] and d["b_noise"] > 0]
        ax.plot([e for e, _ in read], [b for _, b in read], "x", color="black", ms=3,
                label="adaptive: B_simple it read" if i == 0 else None)  # fmt: skip
        best = [(d["examples"], d["optimum"]) for d in decisions if d.get("optimum") is not None and d["optimum"] > 0]
        if best:  # the time rule: the throughput table's optimum √(a·B_noise/b) at each reading
            ax.plot([e for e, _ in best], [b for _, b in best], "+", color="C3", ms=4,
                    label="adaptive: the table's optimum √(a·B_noise/b)" if i == 0 else None)  # fmt: skip
    return True


def draw(study: Study, folder: Path) -> None:
    against_batch(study, folder)
    steps_vs_examples(study, folder)
    val_curves(study, folder)
    noise_scale_curves(study, folder)
