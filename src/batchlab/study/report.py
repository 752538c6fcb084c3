"""The batch-size study's report: tables (CSV, Markdown), the verdict and the plots, from a Study."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchlab import atomic
from batchlab.study import adaptive, clock, critical, local_cbs

if TYPE_CHECKING:
    from batchlab.study.analysis import Study


def _cell(row: dict[str, Any], key: str, digits: int) -> str:
    mean, half = row[f"{key}_mean"], row[f"{key}_ci95"]
    if not math.isfinite(mean):
        return "—"
    return f"{mean:.{digits}f} ± {half:.{digits}f}" if math.isfinite(half) else f"{mean:.{digits}f}"


COLUMNS = (  # header, figure, digits
    ("test F1 (macro)", "test_f1_macro", 4),
    ("test acc", "test_accuracy", 4),
    ("steps to target", "steps_to_target", 0),
    ("examples to target", "examples_to_target", 0),
    ("s to target", "seconds_to_target", 2),
    ("samples/s", "samples_per_s", 0),
    ("step memory (MiB)", "step_memory_mib", 3),
    ("B_simple at target", "gns_b_simple_at_target", 0),
    ("exact B_simple there", "gns_b_simple_exact_at_target", 0),
    ("peak RSS (MiB)", "peak_rss_mib", 0),
)


def table(study: Study) -> str:
    header = "| batch | lr | " + " | ".join(h for h, _, _ in COLUMNS) + " |\n"
    header += "|---:" * (len(COLUMNS) + 2) + "|\n"
    lines = []
    for r in study.rows:
        reached = "" if r["reached"] == r["seeds"] else f" ({r['reached']}/{r['seeds']} reached)"
        cells = [_cell(r, key, digits) for _, key, digits in COLUMNS]
        cells[2] += reached
        lines.append(f"| {_batch_cell(study, r['batch_size'])} | {r['lr']:.4g} | " + " | ".join(cells) + " |")
    return header + "\n".join(lines) + "\n"


def _batch_cell(study: Study, batch: int) -> str:
    """The batch column marks the recommendation and the best mean F1."""
    marks = [m for m, b in (("recommended", study.verdict.recommended), ("best F1", study.verdict.best)) if b == batch]
    return f"**{batch}** ({', '.join(marks)})" if marks else str(batch)


def _bound(value: float) -> str:
    return f"{value:.0f}" if math.isfinite(value) else "beyond the largest batch"


def _excess_text(fit: critical.Fit) -> str:
    """The 20%-excess critical batch size (Zhang et al., ICLR 2025), read from the same points."""
    name = "20%-excess critical batch size (where the steps exceed perfect scaling from the smallest batch by 20%)"
    if not math.isfinite(fit.b_excess):
        return f"The {name}: beyond the largest batch size measured."
    interval = (
        f" (95% interval {_bound(fit.b_excess_low)}–{_bound(fit.b_excess_high)}, the same draws)"
        if math.isfinite(fit.b_excess_low)
        else ""
    )
    return f"The {name}: {fit.b_excess:.0f}{interval}."


def critical_text(study: Study, lr_scaling: str, base_batch: int, optimizer: str, epochs: int) -> str:
    fit = study.fit
    lines = [f"Target: val loss ≤ {study.target:.4f}: {study.target_rule}."]
    missed = [str(r["batch_size"]) for r in study.rows if r["reached"] < r["seeds"]]
    if missed:
        lines.append(f"Batch sizes with seeds that never reached it: {', '.join(missed)}.")
    if isinstance(fit, critical.NoFit):
        lines.append(f"No critical batch size: {fit.reason}.")
    else:
        interval = (
            f" (95% interval {fit.b_crit_low:.0f}–{fit.b_crit_high:.0f}: each batch size's mean steps drawn "
            "from its Student-t interval over seeds, the line refitted 1000 times)"
            if math.isfinite(fit.b_crit_low)
            else " (one seed: no interval)"
        )
        lines.append(
            f"Critical batch size B_crit = {fit.b_crit:.0f}{interval}; S_min = {fit.s_min:.0f} steps, "
            f"E_min = {fit.e_min:.0f} examples; R² = {fit.r2:.3f} over {fit.batch_sizes} batch sizes "
            "(the line 1/S = 1/S_min − B_crit/E through each batch size's mean steps). "
            f"Below about {fit.b_crit:.0f}, doubling the batch nearly halves the steps to the target "
            "(perfect scaling); above it the steps level off toward S_min while the examples, i.e. the "
            "compute, grow (diminishing returns)."
        )
        lines.append(_excess_text(fit))
    lines += noise_text(study)
    lines.append(
        f"What biases it: the lr is scaled by the {lr_scaling} rule from train.lr at batch {base_batch} "
        "(a rule that under-scales large batches inflates their steps); the optimizer is "
        f"{optimizer} (Adam's critical batch runs larger than SGD's); {study.rows[0]['seeds']} seed(s) per "
        f"batch size; every experiment has the same {epochs} epochs, so a schedule that decays with the "
        "epochs gives large batches few steps at a high lr."
    )
    return " ".join(lines)


def noise_text(study: Study) -> list[str]:
    """The noise scale at the target: the exact value where it was computed, the in-training
    estimate beside it, how far apart they are, and the readings that could not be made."""
    fit, truth = study.fit, study.truth
    unread = (
        f"; not read in {study.b_simple_unread} of the experiments that reached it, which are left out: no "
        "probe's reading was complete yet (a probe costs a pass over the train split, so one runs only every "
        "~1/8 of a run's step time, and its reading waits half that) or its |G|² came out at or below zero"
        if study.b_simple_unread
        else ""
    )
    estimate = f"{study.b_simple:.0f}" if math.isfinite(study.b_simple) else "not read"
    if truth.count and math.isfinite(truth.b_simple):
        ratio = f"; B_crit / B_simple = {fit.b_crit / truth.b_simple:.2f}" if isinstance(fit, critical.Fit) else ""
        apart = (
            f", the median of estimate / exact {truth.estimate_over_exact:.2f}, each reading against the exact "
            "value at the weights it measured: the latest probe at or before the target"
            if math.isfinite(truth.estimate_over_exact)
            else ""
        )
        return [
            f"Gradient noise scale at the target: B_simple = {truth.b_simple:.0f} exactly (median over the "
            f"{truth.count} experiments that reached it: tr(Σ)/|G|² from every train row's gradient at the weights "
            f"of the val point where each first reached it, dropout's masks counted as noise){ratio}. The "
            f"in-training estimate there reads {estimate} (median{unread}{apart}). McCandlish et al. find "
            "B_crit ≈ B_simple to within an order of magnitude. B_simple grows as the loss falls (the noise-scale "
            "plot), so the steps B_crit is fitted from are spent mostly at a smaller noise scale than the "
            "target's: a B_crit below the B_simple at the target is what to expect."
        ]
    if math.isfinite(study.b_simple):
        ratio = f"; B_crit / B_simple = {fit.b_crit / study.b_simple:.2f}" if isinstance(fit, critical.Fit) else ""
        return [
            f"Gradient noise scale at the target: B_simple = {study.b_simple:.0f} (the in-training estimate, median "
            f"over experiments{unread}; no exact value: the train split is larger than sweep.exact_noise_rows){ratio}. "
            "McCandlish et al. find B_crit ≈ B_simple to within an order of magnitude."
        ]
    return [f"Gradient noise scale at the target: not read{unread}."] if study.b_simple_unread else []


def lr_text(study: Study) -> str:
    if len(set(study.lr_choice.values())) == 1 and next(iter(study.lr_choice.values())) == 1.0:
        return ""
    picks = ", ".join(f"batch {b}: ×{m:g}" for b, m in sorted(study.lr_choice.items()))
    return f"Learning rate kept per batch size (lowest val loss among sweep.lr_multipliers): {picks}."


def budget_text(study: Study, budget_mb: float | None) -> str:
    if budget_mb is None:
        return ""
    if study.budget_batch is None:
        return f"Memory budget {budget_mb:g} MiB: no batch is predicted to fit a training step in it."
    return (
        f"Memory budget {budget_mb:g} MiB: the largest batch predicted to fit one training step is "
        f"{study.budget_batch} (a line through the measured step memory, extrapolated)."
    )


def headline(study: Study) -> str:
    """The answer in two lines, which the parent run's description opens on: the batch size with its
    price against the best-F1 batch, then what was beaten and the critical batch size."""
    verdict, fit = study.verdict, study.fit
    first = verdict.first_line.replace(
        f"Recommended: batch {verdict.recommended}", f"**Recommended: batch {verdict.recommended}**", 1
    )
    beaten = [
        f"{b} by {', '.join(map(str, verdict.beaten_by(b)))}"
        for b in sorted(r["batch_size"] for r in study.rows)
        if b not in verdict.candidates
    ]
    if isinstance(fit, critical.NoFit):
        crit = f"no critical batch size ({fit.reason})"
    else:
        interval = f", 95% interval {fit.b_crit_low:.0f}–{fit.b_crit_high:.0f}" if math.isfinite(fit.b_crit_low) else ""
        crit = f"critical batch size {fit.b_crit:.0f}{interval}, R² {fit.r2:.3f}"
    text = f"{first}\nBeaten measurably in F1: {'; '.join(beaten) or 'none'}; {crit}.\n"
    if study.adaptive is not None:  # sweep.adaptive: its verdict's last sentence, the goal
        text += "Adaptive batch: " + adaptive.study_verdict(study).rsplit(". ", 1)[-1] + "\n"
    return text


def markdown(study: Study, context: dict[str, Any]) -> str:
    parts = ["# Batch-size study\n"]
    if context.get("run"):
        parts.append(trained_with(context["run"]) + "\n")
    parts += [
        table(study),
        "## Verdict\n",
        study.verdict.text + "\n",
        "## Critical batch size\n",
        critical_text(study, context["lr_scaling"], context["base_batch"], context["optimizer"], context["epochs"])
        + "\n",
    ]
    if study.adaptive is not None:
        parts += ["## Adaptive batch size\n", adaptive.study_text(study) + "\n"]
    if context.get("clock"):
        parts += [clock.heading(context["clock"]) + "\n", clock.text(context["clock"]) + "\n"]
    if context.get("local_cbs"):
        parts.append(local_cbs.section(context["local_cbs"], context["local_cbs_tolerance"], b_crit_interval(study)))
    extra = " ".join(t for t in (lr_text(study), budget_text(study, context["memory_budget_mb"])) if t)
    if extra:
        parts.append(extra + "\n")
    parts.append(
        f"Every figure is a mean ± the half-width of its 95% confidence interval over seeds{_shared(study)}. "
        "Step memory is the tensor peak of the largest training step (parameters, gradients, optimizer state, "
        "the step's rows, activations, and the noise probe's pass over the train split on the steps it "
        f"measures){_plain_memory(study)}; "
        "peak RSS is the whole process, set mostly by the torch runtime.\n"
    )
    return "\n".join(parts)


def trained_with(run: dict[str, Any]) -> str:
    """The report's first line: how every experiment trained (train.strategy, processes, precision)."""
    processes = run["nproc"] * run["nnodes"]
    where = "one process" if run["strategy"] == "single" else f"{processes} processes ({run['nnodes']} machine(s))"
    accum = f", {run['grad_accum_steps']} accumulation steps a batch" if run["grad_accum_steps"] > 1 else ""
    return f"Trained with train.strategy {run['strategy']} on {where}, precision {run['precision']}{accum}."


def b_crit_interval(study: Study) -> tuple[float, float, float] | None:
    """The global B_crit with its 95% interval, where the fit has one."""
    fit = study.fit
    if not isinstance(fit, critical.Fit) or not math.isfinite(fit.b_crit_low):
        return None
    return fit.b_crit, fit.b_crit_low, fit.b_crit_high


def _shared(study: Study) -> str:
    """The table's figures measured once per batch size (no interval), when there are seeds."""
    shared = [
        header
        for header, key, _ in COLUMNS
        if all(
            r["seeds"] > 1 and math.isfinite(r[f"{key}_mean"]) and not math.isfinite(r[f"{key}_ci95"])
            for r in study.rows
        )
    ]
    return f", but {', '.join(shared)}: one measurement per batch size, which its seeds share" if shared else ""


def _plain_memory(study: Study) -> str:
    """The step memory without the noise probe, where it differs: summary.csv has it per batch size."""
    plain = [r.get("step_memory_plain_mib_mean", math.nan) for r in study.rows]
    peak = [r["step_memory_mib_mean"] for r in study.rows]
    if not all(math.isfinite(p) for p in plain) or plain == peak:
        return ""
    return f"; without the probe {min(plain):.3f}–{max(plain):.3f} MiB (step_memory_plain_mib in summary.csv)"


EXPERIMENT_COLUMNS = ("name", "batch_size", "seed", "lr", "test_f1_macro", "test_accuracy", "steps_to_target",
                      "examples_to_target", "seconds_to_target")


def write(study: Study, folder: Path, context: dict[str, Any]) -> str:
    """Write summary.csv, summary.md, experiments.csv, steps_vs_examples.csv, curves.csv and the PNGs;
    return the Markdown."""
    from batchlab.study import plots

    text = markdown(study, context)
    atomic.write_csv(folder / "summary.csv", study.rows)
    # each experiment the verdict compared, by seed: what its paired tests read (a reader can redo them)
    atomic.write_csv(folder / "experiments.csv", [{k: r[k] for k in EXPERIMENT_COLUMNS} for r in study.results],
                     list(EXPERIMENT_COLUMNS))
    atomic.write_text(folder / "summary.md", text)
    points = [
        {
            "name": r["name"],
            "batch_size": r["batch_size"],
            "seed": r["seed"],
            "steps": r["steps_to_target"],
            "examples": r["examples_to_target"],
        }
        for r in study.results
        if r["steps_to_target"] is not None
    ]
    # header only when nothing reached the target: dvc.yaml declares the file either way
    atomic.write_csv(folder / "steps_vs_examples.csv", points, ["name", "batch_size", "seed", "steps", "examples"])
    curves = [
        {"name": r["name"], "batch_size": r["batch_size"], "step": s, "examples": s * r["batch_size"], "val_loss": v}
        for r in study.results
        for s, v in zip(r["curve_steps"], r["curve_val_loss"], strict=True)
    ]
    atomic.write_csv(folder / "curves.csv", curves)
    branched: list[local_cbs.Point] = context.get("local_cbs") or []  # sweep.local_cbs: header only when off
    atomic.write_csv(folder / "local_cbs.csv", local_cbs.rows(branched), list(local_cbs.COLUMNS))
    plots.draw(study, folder)
    plots.local_cbs(branched, b_crit_interval(study), folder)
    return text
