"""Threads per training process: `train.threads: 0` (auto) against explicit 1 and 2 threads, on the
machine as it is and beside one busy process (`python -c "while True: pass"`, started here).

Every training is a `batchlab train` process, as in use: auto decides once, where the process
starts. The three variants run interleaved, REPEATS times in rotated order; a run's figure is its
median per-epoch samples/s over epochs 2..N (epoch 1 warms up), and a variant's is its best run, the
one a neighbour disturbed least (the busy process started here runs through every run). "No
competitor" is the machine as it is: other users' load shows in the load average. Then the
measurement behind auto's rule: one training step on 2 threads against 1, by model width and batch.
The load average at the start of each condition is recorded. Nothing is asserted.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from batchlab.config import ModelConfig
from batchlab.training import threads
from common import Table, cli_env, markdown, progress, verdict

BATCHES = (16, 64, 512)
DEFAULT_WIDTH = [64, 64]  # params.yaml's model
WIDE = [512, 512]  # a model where a second thread pays, when a core is free
VARIANTS = {"auto": 0, "1": 1, "2": 2}
EPOCHS = 5
SAMPLES = 8000
REPEATS = 3
TOLERANCE = 0.10
# the step measurement behind threads.FLOPS_PER_THREAD
STEP_WIDTHS = (64, 256, 1024)
STEP_TRIALS = 3
STEPS_PER_TRIAL = 10


@contextlib.contextmanager
def competing(busy: bool) -> Iterator[None]:
    """One process spinning on a core while the block runs (or nothing)."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        time.sleep(0.5 if busy else 0)  # running before anything is measured
        yield
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()


def params(hidden: list[int], batch: int, threads: int) -> dict[str, Any]:
    return {
        "data": {"samples": SAMPLES},
        "model": {"hidden_sizes": hidden},
        "train": {"epochs": EPOCHS, "batch_size": batch, "threads": threads, "early_stopping_patience": 0},
        "evaluate": {},
        "export": {},
        "tracking": {"enabled": False},
        "sweep": {"batch_sizes": [batch]},
    }


def train(folder: Path, hidden: list[int], batch: int, threads: int) -> dict[str, float]:
    """One `batchlab train` process: its median samples/s over epochs 2..N and the threads it ran."""
    (folder / "params.yaml").write_text(yaml.safe_dump(params(hidden, batch, threads)))
    started = time.perf_counter()
    proc = subprocess.run(["batchlab", "train"], cwd=folder, env=cli_env(), capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"batchlab train exited {proc.returncode}\n{proc.stderr[-4000:]}")
    with (folder / "reports" / "history.csv").open() as f:
        speeds = [float(row["samples_per_s"]) for row in csv.DictReader(f)]
    chosen = json.loads((folder / "reports" / "train.json").read_text())["torch_threads"]  # what auto picked
    return {
        "samples_per_s": statistics.median(speeds[1:]),
        "threads": float(chosen),
        "wall_s": wall,
    }


def compare(folder: Path, hidden: list[int], batch: int) -> dict[str, list[dict[str, float]]]:
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for repeat in range(REPEATS):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:  # each goes first once
            runs[name].append(train(folder, hidden, batch, VARIANTS[name]))
    return runs


def step_seconds(width: int, batch: int, threads: int) -> float:
    """The fastest of STEP_TRIALS: seconds per forward + backward + fused AdamW step."""
    import torch
    import torch.nn.functional as F

    from batchlab.config import ModelConfig
    from batchlab.model import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(hidden_sizes=[width, width]), 10, 2)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    x, y = torch.randn(batch, 10), torch.randint(0, 2, (batch,))
    torch.set_num_threads(threads)
    best = float("inf")
    for _ in range(STEP_TRIALS):
        started = time.perf_counter()
        for _ in range(STEPS_PER_TRIAL):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        best = min(best, (time.perf_counter() - started) / STEPS_PER_TRIAL)
    return best


def step_ratios() -> dict[str, float]:
    """1-thread step time / 2-thread step time (above 1: the second thread pays), per width x batch."""
    ratios = {}
    for width in STEP_WIDTHS:
        for batch in BATCHES:
            step_seconds(width, batch, 1)  # warm-up: first allocations, the thread pool
            one, two = step_seconds(width, batch, 1), step_seconds(width, batch, 2)
            ratios[f"{width}x{batch}"] = one / two
    return ratios


def main() -> dict[str, Any]:
    cases = [(DEFAULT_WIDTH, b) for b in BATCHES] + [(WIDE, 512)]
    auto = Table(
        f"train.threads: auto vs explicit, `batchlab train` per-epoch samples/s (best of {REPEATS} runs, each the "
        f"median of epochs 2-{EPOCHS}; {SAMPLES} rows), {threads.usable_cores()} usable cores",
        [
            "condition",
            "load avg",
            "model",
            "batch",
            "auto (threads)",
            "1 thread",
            "2 threads",
            "auto / best",
            "within 10%",
            "noise: 1-thread runs max/min",
        ],
    )
    rule = Table(
        "Training step, 2 threads vs 1 (1-thread time / 2-thread time; above 1: the second thread pays), "
        f"MLP 10-W-W-2, fastest of {STEP_TRIALS} x {STEPS_PER_TRIAL} steps; auto: 1 thread per "
        f"{threads.FLOPS_PER_THREAD / 1e6:g} MFLOP, and 1 beside a busy core",
        ["condition", "load avg", "width", "batch", "MFLOP/step", "ratio", "auto, 2 free cores"],
    )
    measured: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "params.yaml").write_text(yaml.safe_dump(params(DEFAULT_WIDTH, 64, 1)))
        subprocess.run(["batchlab", "generate"], cwd=folder, env=cli_env(), check=True, capture_output=True)
        for condition, busy in (("no competitor", False), ("1 busy process", True)):
            with competing(busy):
                load = os.getloadavg()[0]
                measured[condition] = {"load_average": load, "cases": {}, "step_ratios": {}}
                for hidden, batch in cases:
                    progress(f"threads: {condition}, model {hidden}, batch {batch}")
                    runs = compare(folder, hidden, batch)
                    load = os.getloadavg()[0]  # the last minute: these runs, beside the condition's load
                    speed = {name: max(r["samples_per_s"] for r in rs) for name, rs in runs.items()}
                    chosen = sorted({int(r["threads"]) for r in runs["auto"]})
                    best = max(speed["1"], speed["2"])
                    ones = [r["samples_per_s"] for r in runs["1"]]  # the same setting thrice: the machine's noise
                    share = speed["auto"] / best
                    auto.add(
                        condition,
                        f"{load:.2f}",
                        "x".join(map(str, hidden)),
                        batch,
                        f"{speed['auto']:,.0f} ({'/'.join(map(str, chosen))})",
                        f"{speed['1']:,.0f}",
                        f"{speed['2']:,.0f}",
                        f"{share:.2f}",
                        verdict(share >= 1 - TOLERANCE),
                        f"{max(ones) / min(ones):.2f}",
                    )
                    key = f"{'x'.join(map(str, hidden))}/{batch}"
                    measured[condition]["cases"][key] = {
                        "best_samples_per_s": speed,
                        "auto_share": share,
                        "runs": runs,
                    }
                progress(f"threads: {condition}, step times by width")
                ratios = step_ratios()
                load = os.getloadavg()[0]
                measured[condition]["step_ratios"] = ratios
                for width in STEP_WIDTHS:
                    for batch in BATCHES:
                        flops = threads.step_flops(ModelConfig(hidden_sizes=[width, width]), 10, 2, batch)
                        wanted = min(2, max(1, int(flops // threads.FLOPS_PER_THREAD)))
                        rule.add(
                            condition,
                            f"{load:.2f}",
                            width,
                            batch,
                            f"{flops / 1e6:.1f}",
                            f"{ratios[f'{width}x{batch}']:.2f}",
                            wanted,
                        )
    return {"tables": [auto.as_dict(), rule.as_dict()], "measured": measured}


if __name__ == "__main__":
    print(markdown(main()["tables"]))
