"""Seeds for the price of one: the sweep's 5 seeds of a batch size trained together vs one seed alone.

Each variant trains a sweep experiment's config (the params.yaml model: MLP [64, 64], dropout
0.1, AdamW, the noise scale on, the val split scored 10x per epoch, early stopping off) on 1
thread, wall time of the training call: fit() for one seed, fit() five times one after another
(what the sweep did before), vectorized.fit_seeds() for five together. The variants run
interleaved in one process, the median of REPEATS is kept, and the load average is recorded
before and after: a neighbour's load hits every variant alike. Target (issue #45): 5 seeds
together in ≤ 1.6x one seed's wall time (#12 asked 2x). The "dropout 0" rows show what the dropout masks cost:
each seed draws its own (one bernoulli_ per seed and layer, the draws its separate run makes),
so they cost as much per seed together as apart. The "floor" row (group_floor) runs the group with
its kernels, each seed's own masks, the group's probe and val scoring and nothing else: what 5
seeds cost at least on this CPU's kernels while each keeps its separate run's masks.

The CNN rows (issue #27) take the same sweep experiment's settings with the built-in CNN
(params.yaml's channels [16, 32], dropout 0.1) on the digits as 8x8 images, batch 32: its seeds
train together through vmap over functional_call (seeds/functional.py), not the MLP's kernels.
Beside each, `arithmetic_floor`: each kind of call a seed's run makes, by one seed's model on its
rows and on 5x them, weighted by how often an epoch makes it: what 5 seeds' arithmetic costs
through one set of weights (their dropout masks included), which no stacking of the seeds shares
away where a call's cost grows with its rows.

    python benchmarks/run_all.py --only seeds    # or `make bench`: results.json and the README tables
    python benchmarks/bench_seeds.py --cnn       # the CNN rows alone, printed (nothing written)
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from batchlab.config import Config, load_config
from batchlab.data import Dataset, build
from batchlab.seeds import vectorized
from batchlab.sweep.plan import experiment_config, plan
from batchlab.tracking import Tracker
from batchlab.training.epochs import epoch_order
from batchlab.training.strategy import Strategy
from batchlab.training.train import fit, split_tensors
from common import REPO, Table, progress, verdict

BATCH_SIZES = (16, 32, 64)
SEEDS = (0, 1, 2, 3, 4)
EPOCHS = 10
REPEATS = 7
TARGET = 1.6  # 5 seeds together in at most 1.6x one seed's wall time (issue #45; #12 asked 2x)
CNN_BATCH = 32
CNN_TARGET = 1.1  # the CNN's 5 seeds within 1.1x of what their arithmetic costs (issue #45)
OUT = REPO / "benchmarks" / "out" / "seeds.md"
PLAIN, QUIET = "dropout 0", "noise probe off"  # the variants beside the sweep's settings
FLOOR = "the group's floor: its kernels, masks, probe and val scoring, no bookkeeping (group_floor)"


def configs(base: Config, batch: int, n_train: int) -> list[Config]:
    cfg = base.model_copy(
        update={
            "train": base.train.model_copy(update={"threads": 1, "device": "cpu"}),
            "tracking": base.tracking.model_copy(update={"enabled": False}),
        }
    )
    exps = [e for e in plan(cfg, n_train) if e.batch_size == batch]
    return [experiment_config(cfg, e) for e in exps]


def seconds(call: Any) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def variants(cfgs: list[Config], dataset: Dataset) -> dict[str, Any]:
    """The sweep's settings, and beside them without dropout (whose masks, one bernoulli_ per seed
    and layer, the draws a separate run makes, cost as much per seed together as apart) and
    without the noise probe (whose passes over the train split cost about as much per seed
    together as apart: their rows already fill a call)."""
    cpu = torch.device("cpu")
    n = len(cfgs)
    plain = [c.model_copy(update={"model": c.model.model_copy(update={"dropout": 0.0})}) for c in cfgs]
    quiet = [c.model_copy(update={"train": c.train.model_copy(update={"gns": False})}) for c in cfgs]
    return {
        "1 seed, fit()": lambda: fit(cfgs[0], dataset, Strategy(cpu)),
        f"{n} seeds, fit() one after another": lambda: [fit(c, dataset, Strategy(cpu)) for c in cfgs],
        f"{n} seeds together, fit_seeds()": lambda: vectorized.fit_seeds(cfgs, dataset, Strategy(cpu)),
        f"1 seed, fit(), {PLAIN}": lambda: fit(plain[0], dataset, Strategy(cpu)),
        f"{n} seeds together, fit_seeds(), {PLAIN}": lambda: vectorized.fit_seeds(plain, dataset, Strategy(cpu)),
        f"1 seed, fit(), {QUIET}": lambda: fit(quiet[0], dataset, Strategy(cpu)),
        f"{n} seeds together, fit_seeds(), {QUIET}": lambda: vectorized.fit_seeds(quiet, dataset, Strategy(cpu)),
        f"{n} seeds, {FLOOR}": lambda: group_floor(cfgs, dataset),
    }


def group_floor(cfgs: list[Config], dataset: Dataset) -> None:
    """The group's run without its bookkeeping: each step draws every seed's own masks (one
    bernoulli_ per seed and layer, as fit_seeds must), runs the stacked kernels (stacked.py's
    forward and backward, written out with no Python around them) and one fused AdamW step; once
    an epoch the group's real probe (probe_together), and the val scoring as often as fit_seeds.
    No losses, norms, schedule, per-seed figures or checkpoints: what 5 seeds cost at least with
    each seed's own masks on this CPU's kernels. The MLP of params.yaml only (two ReLU layers)."""
    tc, (h1_size, h2_size), p = cfgs[0].train, cfgs[0].model.hidden_sizes, cfgs[0].model.dropout
    assert cfgs[0].model.activation == "relu" and h1_size == h2_size, "the floor is written for params.yaml's MLP"
    cpu, n, b = torch.device("cpu"), len(cfgs), tc.batch_size
    x_train, y_train = split_tensors(dataset.train, cpu)
    rows, steps = x_train.shape[0], x_train.shape[0] // b
    seeds = vectorized.restore(cfgs, dataset, Strategy(cpu), steps, [Tracker() for _ in cfgs], None)
    group, _ = vectorized.stack(seeds, Strategy(cpu), (x_train, y_train), steps)
    sizes = [(x_train.shape[1], h1_size), (h1_size, h2_size), (h2_size, dataset.n_classes)]
    w = [torch.randn(n, i, o) * 0.1 for i, o in sizes] + [torch.zeros(n, 1, o) for _, o in sizes]
    for t in w:
        t.grad = torch.zeros_like(t)
    optimizer = torch.optim.AdamW(w, lr=tc.lr, fused=True)
    masks = [torch.empty(n, b, h1_size), torch.empty(n, b, h2_size)]
    parts = [m.unbind() for m in masks]
    generators = [torch.Generator().manual_seed(c.train.seed) for c in cfgs]
    x_val = split_tensors(dataset.val, cpu)[0]
    for epoch in range(tc.epochs):
        orders = torch.stack([epoch_order(c.train.seed, epoch, rows) for c in cfgs])
        by_step = orders[:, : steps * b].view(n, steps, b).transpose(0, 1).reshape(steps, n * b)
        for step in range(steps):
            x = x_train.index_select(0, by_step[step]).view(n, b, -1)
            y = y_train.index_select(0, by_step[step]).view(n, b)
            for i, generator in enumerate(generators):
                parts[0][i].bernoulli_(1 - p, generator=generator)
                parts[1][i].bernoulli_(1 - p, generator=generator)
            for m in masks:
                m.div_(1 - p)
            a1 = torch.baddbmm(w[3], x, w[0]).relu()
            h1 = a1 * masks[0]
            a2 = torch.baddbmm(w[4], h1, w[1]).relu()
            h2 = a2 * masks[1]
            log_probs = F.log_softmax(torch.baddbmm(w[5], h2, w[2]), 2)
            g = torch.zeros_like(log_probs).scatter_(2, y.unsqueeze(2), -1.0 / b)
            g = torch.ops.aten._log_softmax_backward_data(g, log_probs, 2, log_probs.dtype)
            for h, weight, bias, activation, mask in ((h2, w[2], w[5], a2, masks[1]), (h1, w[1], w[4], a1, masks[0])):
                torch.bmm(h.transpose(1, 2), g, out=weight.grad)
                torch.sum(g, 1, keepdim=True, out=bias.grad)
                g = torch.ops.aten.threshold_backward(torch.bmm(g, weight.transpose(1, 2)) * mask, activation, 0)
            torch.bmm(x.transpose(1, 2), g, out=w[0].grad)
            torch.sum(g, 1, keepdim=True, out=w[3].grad)
            optimizer.step()
            if tc.eval_every_steps and (epoch * steps + step + 1) % tc.eval_every_steps == 0:
                group.predict(x_val)
        if tc.gns:
            group.probe_together(seeds, (epoch + 1) * steps)
        group.predict(x_val)


def _alone(variant: str) -> str:
    """The one-seed variant of the same settings."""
    return "1 seed, fit()" + next((f", {s}" for s in (PLAIN, QUIET) if variant.endswith(s)), "")


def interleaved(runs: dict[str, Any], what: str) -> dict[str, list[float]]:
    """Each variant's wall seconds, REPEATS times, the variants taking turns."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(REPEATS):
        progress(f"seeds: {what}, repeat {repeat + 1}/{REPEATS}")
        for name, call in runs.items():
            times[name].append(seconds(call))
    return times


def cnn_rows(base: Config) -> dict[str, Any]:
    """The CNN at batch CNN_BATCH: one seed, five one after another, five together (vmap)."""
    cfg = base.model_copy(
        update={"data": base.data.model_copy(update={"source": "digits_images"}),
                "model": base.model.model_copy(update={"name": "cnn"})}
    )  # fmt: skip
    dataset = build(cfg.data)[0]
    n_train = dataset.train.y.shape[0]
    cfgs = configs(cfg, CNN_BATCH, n_train)
    cpu, n = torch.device("cpu"), len(cfgs)
    runs = {
        "1 seed, fit()": lambda: fit(cfgs[0], dataset, Strategy(cpu)),
        f"{n} seeds, fit() one after another": lambda: [fit(c, dataset, Strategy(cpu)) for c in cfgs],
        f"{n} seeds together, fit_seeds() (vmap)": lambda: vectorized.fit_seeds(cfgs, dataset, Strategy(cpu)),
    }
    load_before = os.getloadavg()[0]
    vectorized.fit_seeds(cfgs[:2], dataset, Strategy(cpu))  # torch.func's first calls: paid here
    times = interleaved(runs, f"cnn batch {CNN_BATCH}")
    median = {name: statistics.median(t) for name, t in times.items()}
    load_after = os.getloadavg()[0]
    floor_table, floor = arithmetic_floor(cfgs[0], dataset, "the CNN")
    table = Table(
        f"Seeds trained together, the CNN: a sweep experiment's training, {EPOCHS} epochs over {n_train} "
        f"8x8 digit images, CNN [16, 32], dropout 0.1, AdamW, noise scale on, 1 thread, wall seconds, median "
        f"of {REPEATS}; load average {load_before:.2f} before, {load_after:.2f} after",
        ["batch", "variant", "seconds", "vs 1 seed", "arithmetic floor", f"target ≤ {CNN_TARGET:g}× the floor"],
    )
    for name in runs:
        ratio = median[name] / median["1 seed, fit()"]
        mine = "together" in name
        target = verdict(ratio <= CNN_TARGET * floor) if mine else ""
        table.add(CNN_BATCH, name, f"{median[name]:.2f}", f"{ratio:.2f}×", f"{floor:.2f}×" if mine else "", target)
    return {"table": table, "floor": floor_table, "floor_ratio": floor, "seconds": times, "median_seconds": median,
            "load_average_before": load_before, "load_average_after": load_after}  # fmt: skip


def _best_ms(call: Any, repeats: int = 15) -> float:
    call()  # warm-up
    return min(seconds(call) for _ in range(repeats)) * 1e3


def arithmetic_floor(cfg: Config, dataset: Dataset, what: str) -> tuple[Table, float]:
    """What 5 seeds' arithmetic costs on this machine: each kind of call a seed's run makes, by one
    seed's model on its rows and on 5x them (5 seeds' rows through one set of weights: their
    dropout masks drawn too), weighted by how often an epoch makes it. Where the calls cost in
    proportion to their rows, no way of stacking the seeds brings 5 of them near one seed's time.
    Returns the table and the weighted epoch's ratio."""
    from batchlab.training.gns_probes import PARTS, ROW_SAMPLE, FullSplitProbe, row_squares
    from batchlab.training.train import initial_model, predict_logits, split_tensors

    tc, cpu = cfg.train, torch.device("cpu")
    with torch.random.fork_rng():
        model = initial_model(cfg, dataset.input_shape, dataset.n_classes, dataset.vocab).train()
    x, y = split_tensors(dataset.train, cpu)
    xv, _ = split_tensors(dataset.val, cpu)
    probe = FullSplitProbe(model, F.cross_entropy, x, y)  # its passes: 2 with dropout, 1 without
    n_seeds = len(SEEDS)

    def times(t: torch.Tensor, k: int) -> torch.Tensor:  # t's rows k times over
        return t.repeat(k, *[1] * (t.dim() - 1))

    def step(rows: int) -> Any:  # a training step's forward and backward
        xs, ys = times(x, n_seeds)[:rows], times(y, n_seeds)[:rows]
        return lambda: torch.autograd.grad(F.cross_entropy(model(xs), ys), probe.params)

    def passes(k: int) -> Any:  # the probe's own pass over the train split (its chunks)
        xs, ys = times(x, k), times(y, k)
        return lambda: probe._summed_gradient(xs, ys, PARTS)

    def val(k: int) -> Any:
        rows = times(xv, k)
        return lambda: (predict_logits(model, rows, Strategy(cpu)), model.train())

    def own(k: int) -> Any:
        rows = min(x.shape[0], ROW_SAMPLE)
        xs, ys = times(x[:rows], k), times(y[:rows], k)
        return lambda: row_squares(model, F.cross_entropy, xs, ys)

    steps = dataset.train.y.shape[0] // tc.batch_size
    probes = steps // (tc.gns_every or steps)
    per_epoch = {"training step": steps, "val scoring": steps // (tc.eval_every_steps or steps) + 1,
                 "probe: a pass over the train split": probe.passes * probes,
                 "probe: rows' own gradients": probes}  # fmt: skip
    calls = {"training step": (step(tc.batch_size), step(n_seeds * tc.batch_size)),
             "val scoring": (val(1), val(n_seeds)),
             "probe: a pass over the train split": (passes(1), passes(n_seeds)),
             "probe: rows' own gradients": (own(1), own(n_seeds))}  # fmt: skip
    table = Table(
        f"What {n_seeds} seeds' arithmetic costs, {what}: each call of a seed's run (batch {tc.batch_size}, "
        f"1 thread) by one seed's model on its rows and on {n_seeds}x them, fastest of 15; load average "
        f"{os.getloadavg()[0]:.2f}",
        ["call", "per epoch", "its rows, ms", f"{n_seeds}x the rows, ms", "ratio"],
    )
    one = five = 0.0
    for name, (single, many) in calls.items():
        a, b = _best_ms(single), _best_ms(many)
        one, five = one + per_epoch[name] * a, five + per_epoch[name] * b
        table.add(name, per_epoch[name], f"{a:.2f}", f"{b:.2f}", f"{b / a:.2f}×")
    table.add("an epoch, weighted", "", f"{one:.0f}", f"{five:.0f}", f"{five / one:.2f}×")
    return table, five / one


def study_base() -> Config:
    base = load_config(REPO / "params.yaml")
    return base.model_copy(
        update={"sweep": base.sweep.model_copy(update={"batch_sizes": list(BATCH_SIZES), "seeds": list(SEEDS),
                                                        "epochs": EPOCHS, "lr_multipliers": [1.0]})}
    )  # fmt: skip


def print_table(table: Table) -> None:
    print(f"**{table.title}**")
    for row in table.rows:
        print(" | ".join(row))


def main() -> dict[str, Any]:
    torch.set_num_threads(1)
    base = study_base()
    dataset = build(base.data)[0]
    n_train = dataset.train.y.shape[0]
    load_before = os.getloadavg()[0]
    table = Table(
        f"Seeds trained together: a sweep experiment's training, {EPOCHS} epochs over {n_train} rows, "
        f"MLP [64, 64], dropout 0.1, AdamW, noise scale on, 1 thread, wall seconds, median of {REPEATS}",
        ["batch", "variant", "seconds", "vs 1 seed (same settings)", f"target ≤ {TARGET:g}× 1 seed"],
    )
    measured: dict[str, Any] = {}
    # torch.func's first call in a process costs ~1 s: paid here, not by the first variant
    fit(configs(base, BATCH_SIZES[-1], n_train)[0], dataset, Strategy(torch.device("cpu")))
    for batch in BATCH_SIZES:
        runs = variants(configs(base, batch, n_train), dataset)
        times = interleaved(runs, f"batch {batch}")
        median = {name: statistics.median(t) for name, t in times.items()}
        for name in runs:
            ratio = median[name] / median[_alone(name)]
            target = verdict(ratio <= TARGET) if name.endswith("together, fit_seeds()") else ""
            table.add(batch, name, f"{median[name]:.2f}", f"{ratio:.2f}×", target)
        measured[str(batch)] = {"seconds": times, "median_seconds": median}
    load = {"load_average_before": load_before, "load_average_after": os.getloadavg()[0]}
    table.title += f"; load average {load_before:.2f} before, {load['load_average_after']:.2f} after"
    cnn = cnn_rows(base)
    measured[f"cnn-{CNN_BATCH}"] = {k: v for k, v in cnn.items() if k not in ("table", "floor")}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n\n".join(f"**{t.title}**\n\n" + "\n".join(" | ".join(row) for row in t.rows)
                               for t in (table, cnn["table"], cnn["floor"])) + "\n")  # fmt: skip
    for t in (table, cnn["table"], cnn["floor"]):
        print_table(t)
    tables = [table.as_dict(), cnn["table"].as_dict(), cnn["floor"].as_dict()]
    return {"tables": tables, "measured": measured, **load}


if __name__ == "__main__":
    if "--cnn" in sys.argv[1:]:
        torch.set_num_threads(1)
        cnn = cnn_rows(study_base())
        print_table(cnn["table"])
        print_table(cnn["floor"])
    else:
        main()
