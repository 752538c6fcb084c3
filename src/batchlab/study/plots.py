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
    """Test F1, throughput and step memory against batch size, each with what its interval is (in
    the axis label: the titles stay short enough to fit); the recommended and best-F1 batch sizes
    marked on the F1 chart, the step memory with and without the noise probe."""
    plt = _pyplot()
    batches = [r["batch_size"] for r in study.rows]
    for key, label, title, name in (
        ("test_f1_macro", "test F1 (macro)", "Test F1 vs batch size", "f1_vs_batch.png"),
        ("samples_per_s", "samples/s (side-by-side table)", "Throughput vs batch size", "throughput_vs_batch.png"),
        ("step_memory_mib", "step tensor memory (MiB)", "Step memory vs batch size", "memory_vs_batch.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        means = [r[f"{key}_mean"] for r in study.rows]
        halves = [r[f"{key}_ci95"] for r in study.rows]
        errors = [h if h == h else 0.0 for h in halves]  # NaN: one measurement, no interval
        shown = "mean, 95% CI over seeds" if any(h == h for h in halves) else "one measurement per batch size"
        if key == "step_memory_mib":
            _memory(ax, study, batches)
        else:
            ax.errorbar(batches, means, yerr=errors, marker="o", capsize=3, label=shown)
        if key == "test_f1_macro":
            _marked(ax, study, batches, means)
        ax.set(xlabel="batch size", ylabel=label)
        ax.set_title(title, fontsize=11)
        ax.legend(fontsize=7)
        _batch_axis(ax, batches)
        fig.tight_layout()
        _save(fig, folder / name)


def _marked(ax: Any, study: Study, batches: list[int], means: list[float]) -> None:
    verdict = study.verdict
    for batch, marker, text in ((verdict.best, "s", "best F1"), (verdict.recommended, "*", "recommended")):
        ax.plot(batch, means[batches.index(batch)], marker, ms=12, mfc="none", mec="C3", label=f"{text}: {batch}")


def _memory(ax: Any, study: Study, batches: list[int]) -> None:
    """The step's own tensors (the batch's cost) and the peak with the noise probe's pass, which a
    probing step adds: two lines, log scale, since the probe's pass can dwarf a small batch's step."""
    plain = [r.get("step_memory_plain_mib_mean", float("nan")) for r in study.rows]
    peak = [r["step_memory_mib_mean"] for r in study.rows]
    if all(v == v for v in plain):
        ax.plot(batches, plain, "o-", label="a training step (the batch's own cost)")
    ax.plot(batches, peak, "s--", color="C1", label="the peak with the noise probe's pass")
    ax.set_yscale("log")


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
                color="C3", ms=5, label="adaptive (each seed)")
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
    """The measured B_simple over training, against examples seen: one line per batch size through
    its readings (the mean over seeds at the weights each probe measured; between probes the curve
    holds the last reading, which is not drawn), with reference lines at B_crit and at the exact
    B_simple at the target."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for i, batch in enumerate(sorted(study.lr_choice)):
        by_step: dict[int, list[float]] = {}
        for r in (r for r in study.results if r["batch_size"] == batch):
            measured = r.get("curve_b_simple_measured_at") or r["curve_steps"]
            readings = {
                int(m): v for m, v in zip(measured, r["curve_b_simple"], strict=True) if m == m and v == v and v > 0
            }
            for step, value in readings.items():
                by_step.setdefault(step, []).append(value)
        if by_step:
            steps = sorted(by_step)
            ax.plot([s * batch for s in steps], [sum(by_step[s]) / len(by_step[s]) for s in steps], "o-", ms=2.5,
                    color=f"C{i % 10}", lw=0.9, label=f"batch {batch}")
            drawn = True
    drawn = _adaptive_schedule(ax, study) or drawn
    fit, exact = study.fit, study.truth.b_simple
    if isinstance(fit, critical.Fit):
        ax.axhline(fit.b_crit, color="black", lw=1, ls="--", label=f"B_crit {fit.b_crit:.0f}")
    if exact == exact and exact > 0:
        ax.axhline(exact, color="grey", lw=1, ls="-.", label=f"exact B_simple at the target {exact:.0f}")
    if drawn:
        from matplotlib.ticker import NullFormatter

        ax.set(xscale="log", yscale="log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # 2×10³, 3×10³, ... print over each other
        ax.legend(fontsize=7, ncol=2)
    else:
        ax.text(0.5, 0.5, "no noise-scale readings", transform=ax.transAxes, ha="center")
    ax.set(xlabel="examples seen", ylabel="B_simple (measured, mean over seeds)")
    ax.set_title("Gradient noise scale over training", fontsize=11)
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
                label="adaptive: B_simple it read" if i == 0 else None)
        best = [(d["examples"], d["optimum"]) for d in decisions if d.get("optimum") is not None and d["optimum"] > 0]
        if best:  # the time rule: the throughput table's optimum √(a·B_noise/b) at each reading
            ax.plot([e for e, _ in best], [b for _, b in best], "+", color="C3", ms=4,
                    label="adaptive: the table's optimum √(a·B_noise/b)" if i == 0 else None)
    return True


def draw(study: Study, folder: Path) -> None:
    against_batch(study, folder)
    steps_vs_examples(study, folder)
    val_curves(study, folder)
    noise_scale_curves(study, folder)


def local_cbs(points: list[Any], b_crit: tuple[float, float, float] | None, folder: Path) -> None:
    """sweep.local_cbs: the local critical batch size at each point with its interval, beside the
    exact B_simple there and the in-training estimate, against examples seen, and the global B_crit
    with its interval (study/local_cbs.py's Points)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    measured = [p for p in points if p.result.measured]
    if measured:
        x = [p.examples for p in measured]
        cbs = [p.result.multiplier * p.batch for p in measured]
        low = [c - p.result.low * p.batch for c, p in zip(cbs, measured, strict=True)]
        high = [p.result.high * p.batch - c for c, p in zip(cbs, measured, strict=True)]
        ax.errorbar(x, cbs, yerr=[low, high], fmt="o-", color="black", capsize=3, label="local CBS (95% interval)")
        for key, style, label in (
            ("b_simple_exact", "s--", "exact B_simple"),
            ("b_simple_estimate", "x:", "in-training estimate"),
        ):
            pairs = [(p.examples, getattr(p, key)) for p in measured if getattr(p, key) == getattr(p, key)]
            if pairs:
                ax.plot([e for e, _ in pairs], [v for _, v in pairs], style, ms=4, label=label)
        if b_crit is not None:
            ax.axhline(b_crit[0], color="C3", lw=1, label=f"global B_crit {b_crit[0]:.0f}")
            ax.axhspan(b_crit[1], b_crit[2], color="C3", alpha=0.12)
        ax.set(yscale="log")
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "sweep.local_cbs is off" if not points else "no point measured", transform=ax.transAxes,
                ha="center")
    ax.set(xlabel="examples seen", ylabel="batch size")
    ax.set_title("Local critical batch size through training", fontsize=11)
    fig.tight_layout()
    _save(fig, folder / "local_cbs.png")
