"""What measuring the gradient noise scale costs: fit() with train.gns on vs off, one process.

The params.yaml model (MLP [64, 64], dropout 0.1, AdamW) on 1 thread at batch 16, 64, 256 and 512.
On one process (with or without accumulation) the probe takes the mean gradient over the train
split (up to gns_probes.FULL_SPLIT_ROWS rows) twice, with independent dropout masks: two passes
over 4096 rows here, each about as dear as a step of that many rows, so fit() measures every k-th
step with k from the cost model in gns_probes (`full_split_every`, aiming at
gns_probes.FULL_SPLIT_OVERHEAD of the steps' time). Variants
run interleaved and the fastest of REPEATS is kept (a neighbour's load only adds time: side by
side medians scattered by ±10% here); the load average is recorded.

    python benchmarks/run_all.py --only gns    # or `make bench`: results.json and the README tables
"""

from __future__ import annotations

import math
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from batchlab.config import Config, load_config
from batchlab.data import Dataset, build
from batchlab.training import gns_probes
from batchlab.training.strategy import Strategy
from batchlab.training.train import fit, initial_model
from common import REPO, Table, progress

BATCH_SIZES = (16, 64, 256, 512)
EPOCHS = 3
PROBES = 4  # at least this many probes per run: a run shorter than the probe's period measures nothing
REPEATS = 3  # the fastest of 3 per variant: the benchmark takes minutes
ROW_REPEATS = 7
COLUMNS = ["model", "parameters", "vmap, 64 rows a call", "vmap, row_chunk", "rows a call", "one batched pass", "vs 64"]
OVERHEAD_TARGET = 0.10  # issue #11: gns costs at most 10% of step time
RESULTS = REPO / "benchmarks" / "gns_results.json"
# name -> (train overrides, per-example measuring period; None = the default)
VARIANTS: dict[str, tuple[dict[str, Any], int | None]] = {
    "off": ({"gns": False}, None),
    "on": ({"gns": True}, None),
    "off, accum 4": ({"gns": False, "grad_accum_steps": 4}, None),
    "on, accum 4": ({"gns": True, "grad_accum_steps": 4}, None),
}


def epochs_for(batch: int, rows: int, every: int) -> int:
    """EPOCHS, or enough for the probe to measure PROBES times (large batches take few steps)."""
    return max(EPOCHS, math.ceil(PROBES * every / (rows // batch)))


def config(batch_size: int, train: dict[str, Any], epochs: int = EPOCHS) -> Config:
    base = load_config(REPO / "params.yaml")
    fixed = {"epochs": epochs, "batch_size": batch_size, "early_stopping_patience": 0, "threads": 1, "device": "cpu"}
    return base.model_copy(
        update={
            "data": base.data.model_copy(update={"samples": 20_000}),
            "train": base.train.model_copy(update={**fixed, **train}),
            "tracking": base.tracking.model_copy(update={"enabled": False}),
        }
    )


def train_seconds(cfg: Config, dataset: Dataset, every: int | None, checkpoint: Path) -> float:
    """Seconds of training steps (the epochs' epoch_seconds: no validation or checkpoint)."""
    checkpoint.unlink(missing_ok=True)
    default = gns_probes.full_split_every
    if every is not None:
        gns_probes.full_split_every = lambda rows, batch, passes: every  # type: ignore[assignment]
    try:
        strategy = Strategy(torch.device("cpu"), grad_accum_steps=cfg.train.grad_accum_steps)
        history = fit(cfg, dataset, strategy, checkpoint=checkpoint).history
    finally:
        gns_probes.full_split_every = default
    return sum(row["epoch_seconds"] for row in history)


def main() -> dict[str, Any]:
    torch.set_num_threads(1)
    dataset = build(config(BATCH_SIZES[0], {}).data)[0]
    rows = dataset.train.y.shape[0]
    periods = {b: gns_probes.full_split_every(min(rows, gns_probes.FULL_SPLIT_ROWS), b, 2) for b in BATCH_SIZES}
    table = Table(
        f"Gradient noise scale cost: fit() over {rows} rows, MLP [64, 64], dropout 0.1, AdamW, 1 thread, fastest of "
        f"{REPEATS}; the probe's period from its cost model, and the epochs for {PROBES}+ probes: "
        + ", ".join(f"batch {b} every {k} ({epochs_for(b, rows, k)} epochs)" for b, k in periods.items()),
        ["batch", "variant", "ms/step", "vs off", "target ≤ +10%"],
    )
    measured: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        # the first probe in a process pays autograd's warm-up: here, not in the first variant
        train_seconds(config(BATCH_SIZES[-1], {}, 1), dataset, 1, Path(tmp) / "c.pt")
        for batch in BATCH_SIZES:
            epochs = epochs_for(batch, rows, periods[batch])
            steps = epochs * (rows // batch)
            times: dict[str, list[float]] = {name: [] for name in VARIANTS}
            for repeat in range(REPEATS):
                progress(f"gns: batch {batch}, repeat {repeat + 1}/{REPEATS}")
                for name, (train, every) in VARIANTS.items():
                    cfg = config(batch, train, epochs)
                    times[name].append(train_seconds(cfg, dataset, every, Path(tmp) / "c.pt"))
            median = {name: min(t) for name, t in times.items()}  # the fastest: see the docstring
            for name in VARIANTS:
                base = median["off, accum 4" if "accum" in name else "off"]
                ratio = median[name] / base
                default = not name.startswith("off") and "every" not in name  # what fit() runs
                met = ("met" if ratio <= 1 + OVERHEAD_TARGET else "MISSED") if default else ""
                table.add(batch, name, f"{1000 * median[name] / steps:.3f}", f"{ratio:.3f}×", met)
            measured[str(batch)] = {"steps": steps, "seconds": times, "fastest_seconds": median}
    chunks = row_chunks()
    return {"tables": [table.as_dict(), chunks.as_dict()], "measured": measured,
            "probe_every": {str(b): k for b, k in periods.items()}}  # fmt: skip


def row_chunks() -> Table:
    """What one probe's rows' own gradients (gns_probes.ROW_SAMPLE rows) cost for the three built-in
    models on their example data: through vmap 64 rows a call (before #45) and gns_probes.row_chunk
    rows a call, and for the MLP from one batched pass (linear_row_squares, what it runs now);
    interleaved, the fastest of ROW_REPEATS each."""
    base = load_config(REPO / "params.yaml")
    models = {"mlp": "synthetic", "cnn": "digits_images", "transformer": "sequences"}
    table = Table(
        f"The rows' own gradients: one probe's {gns_probes.ROW_SAMPLE} rows, ms, fastest of {ROW_REPEATS}, 1 thread",
        COLUMNS,
    )
    loss = torch.nn.functional.cross_entropy
    for name, source in models.items():
        cfg = base.model_copy(update={"data": base.data.model_copy(update={"source": source}),
                                      "model": base.model.model_copy(update={"name": name})})  # fmt: skip
        dataset = build(cfg.data)[0]
        model = initial_model(cfg, dataset.input_shape, dataset.n_classes, dataset.vocab).train()
        x = torch.from_numpy(dataset.train.x[: gns_probes.ROW_SAMPLE])
        y = torch.from_numpy(dataset.train.y[: gns_probes.ROW_SAMPLE])
        params = sum(p.numel() for p in model.parameters())
        sized = gns_probes.row_chunk(params)
        one_pass = gns_probes.linear_row_squares(model, loss, x, y) is not None
        calls = {"64": partial(_vmap_seconds, model, x, y, 64), "sized": partial(_vmap_seconds, model, x, y, sized)}
        if one_pass:
            calls["pass"] = partial(_seconds, partial(gns_probes.linear_row_squares, model, loss, x, y))
        times: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(ROW_REPEATS):
            for key, call in calls.items():
                times[key].append(call())
        best = {k: 1000 * min(v) for k, v in times.items()}
        now = best["pass"] if one_pass else best["sized"]
        table.add(name, params, f"{best['64']:.1f}", f"{best['sized']:.1f}", sized,
                  f"{best['pass']:.2f}" if one_pass else "", f"{now / best['64']:.2f}×")  # fmt: skip
    return table


def _seconds(call: Any) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def _vmap_seconds(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int) -> float:
    limit = gns_probes.ROW_CHUNK
    gns_probes.ROW_CHUNK = chunk
    try:
        return _seconds(lambda: gns_probes._vmapped_row_squares(model, torch.nn.functional.cross_entropy, x, y))
    finally:
        gns_probes.ROW_CHUNK = limit


if __name__ == "__main__":
    main()
