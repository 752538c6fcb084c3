"""Stage start-up: the four pipeline stages (generate, train, evaluate, export) as `batchlab <stage>`
processes at default params, tracked in a SQLite MLflow store, against the import floor
(`python -c "import torch, mlflow, sklearn"`) measured in the same rounds; and the two ONNX exporters.

Each round runs the floor, the four stages as plain processes (their wall times make the target),
then the four stages again under a probe that splits each process's time into import (loading
modules not loaded yet), tracking (MLflow-facing calls, less their imports), work (the rest) and
startup + exit (wall time outside the probed code), and times the garbage collector's passes (its
own column: they fall inside the others). Each round also runs the four stages with the collector on
throughout (batchlab.collector pauses it while a command loads), for the difference side by side.
The first round creates the store and is reported apart. Medians over ROUNDS. Nothing is asserted.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from common import REPO, Table, cli_env, markdown, progress, run_cli, verdict

STAGES = ("generate", "train", "evaluate", "export")
FLOOR = "import torch, mlflow, sklearn"
TARGET = 4.0  # the four stages within this many import floors
ROUNDS = 5
HEAVY = ("torch", "mlflow", "sklearn", "onnxruntime", "torch._dynamo", "onnxscript", "matplotlib")

# Runs `batchlab <stage>` as the program does (batchlab.cli.main() ends the process), charging each
# moment to one category: import while a module not yet loaded loads, tracking inside an MLflow-facing
# call, work otherwise. The figures are written from an atexit handler, which the program runs.
PROBE = r"""
import atexit, functools, gc, importlib._bootstrap as bootstrap, json, os, sys, time

started = time.perf_counter()
seconds = {"import": 0.0, "tracking": 0.0, "work": 0.0}
inside = []
mark = [started]

collector = [0.0, 0.0]  # seconds in the garbage collector's passes, start of the current pass

def in_collector(phase, info):
    if phase == "start":
        collector[1] = time.perf_counter()
    else:
        collector[0] += time.perf_counter() - collector[1]

gc.callbacks.append(in_collector)

def charge():
    now = time.perf_counter()
    seconds[inside[-1] if inside else "work"] += now - mark[0]
    mark[0] = now

def timed(category, call):
    @functools.wraps(call)
    def wrapper(*args, **kwargs):
        charge()
        inside.append(category)
        try:
            return call(*args, **kwargs)
        finally:
            charge()
            inside.pop()
    return wrapper

bootstrap._find_and_load = timed("import", bootstrap._find_and_load)

from batchlab import tracking
from batchlab.tracking import mlflow_tracker

class TimedRun:
    def __init__(self, open_run):
        self.open_run = open_run
    def __call__(self, *args, **kwargs):
        context = self.open_run(*args, **kwargs)
        class Timed:
            def __enter__(self):
                return timed("tracking", context.__enter__)()
            def __exit__(self, *exc):
                return timed("tracking", context.__exit__)(*exc)
        return Timed()

tracking.run = TimedRun(tracking.run)
for name in ("attach", "quiet_mlflow", "environment_tags", "origin"):
    setattr(tracking, name, timed("tracking", getattr(tracking, name)))
for name, member in list(vars(mlflow_tracker.MlflowTracker).items()):
    if callable(member) and not name.startswith("__"):
        setattr(mlflow_tracker.MlflowTracker, name, timed("tracking", member))

@atexit.register
def report():
    charge()
    loaded = [m for m in os.environ["PROBE_HEAVY"].split(",") if m in sys.modules]
    with open(os.environ["PROBE_OUT"], "w") as f:
        json.dump({**seconds, "collector": collector[0], "in_process": time.perf_counter() - started,
                   "loaded": loaded}, f)

sys.argv = ["batchlab", *sys.argv[1:]]
from batchlab.cli import main
main()
"""

# One ONNX export of the trained model in a fresh process: the first call pays the exporter's
# lazy imports, the second does not; then export's parity gate.
EXPORTER = r"""
import json, sys, time, warnings
import torch
from batchlab.inference import export
from batchlab.data import load
from batchlab.model import load_model

dynamo = sys.argv[1] == "dynamo"
model, _ = load_model("models/model.pt")
dataset = load("data/prepared")
calls = []
for attempt in range(2):
    path = f"model-{sys.argv[1]}-{attempt}.onnx"
    started = time.perf_counter()
    kwargs = {"dynamic_shapes": ({0: torch.export.Dim("batch", min=1)},)} if dynamo else {
        "dynamic_axes": {"features": {0: "batch"}, "logits": {0: "batch"}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.zeros(2, dataset.n_features),), path, input_names=["features"],
                          output_names=["logits"], opset_version=18, dynamo=dynamo, external_data=False,
                          verbose=False, **kwargs)
    calls.append(time.perf_counter() - started)
try:
    parity = max(r.max_abs_diff for r in export.check_parity(model, path, dataset.test.x, 1e-4))
    passed = True
except export.ParityError:
    parity, passed = float("nan"), False
import onnx
nodes = [n.op_type for n in onnx.load(path).graph.node]
print(json.dumps({"first_s": calls[0], "second_s": calls[1], "max_abs_diff": parity, "passed": passed,
                  "nodes": nodes, "dynamo_loaded": "onnxscript" in sys.modules}))
"""


# `batchlab <stage>` with the garbage collector on from the start, as a plain `python` runs
COLLECTING = r"""
import sys
from batchlab import cli
cli.LONG_LIVED.add(sys.argv[1])
sys.argv = ["batchlab", *sys.argv[1:]]
cli.main()
"""


def probed(stage: str, cwd: Path) -> dict[str, Any]:
    out = cwd / f".probe-{stage}.json"
    wall = run_cli([sys.executable, "-c", PROBE, stage], cwd, PROBE_OUT=str(out), PROBE_HEAVY=",".join(HEAVY))
    figures: dict[str, Any] = json.loads(out.read_text())
    figures["startup_exit"] = wall - figures.pop("in_process")
    figures["wall"] = wall
    return figures


def one_round(cwd: Path) -> dict[str, Any]:
    floor = run_cli([sys.executable, "-c", FLOOR], cwd)
    plain = {stage: run_cli(["batchlab", stage], cwd) for stage in STAGES}
    collecting = {stage: run_cli([sys.executable, "-c", COLLECTING, stage], cwd) for stage in STAGES}
    parts = {stage: probed(stage, cwd) for stage in STAGES}
    return {"floor": floor, "plain": plain, "collecting": collecting, "probed": parts}


def exporters(cwd: Path) -> dict[str, dict[str, Any]]:
    found = {}
    for name in ("torchscript", "dynamo"):
        proc = subprocess.run(
            [sys.executable, "-c", EXPORTER, name], cwd=cwd, env=cli_env(), capture_output=True, text=True, check=True
        )
        found[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    return found


def main() -> dict[str, Any]:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        params["tracking"]["tracking_uri"] = f"sqlite:///{cwd / 'mlflow.db'}"
        (cwd / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        load = os.getloadavg()[0]
        progress("startup: first round (creates the MLflow store)")
        first = one_round(cwd)
        for number in range(ROUNDS):
            progress(f"startup: round {number + 1}/{ROUNDS}")
            rounds.append(one_round(cwd))
        progress("startup: ONNX exporters")
        onnx_export = exporters(cwd)
        load_after = os.getloadavg()[0]

    def median(pick: Any) -> float:
        return statistics.median(pick(r) for r in rounds)

    floor = median(lambda r: r["floor"])
    stages = Table(
        f"`batchlab <stage>` at default params, MLflow tracking on (SQLite store exists), seconds, median of "
        f"{ROUNDS} rounds; load average {load:.2f} at start, {load_after:.2f} at end",
        [
            "stage",
            "wall",
            "import",
            "work",
            "tracking",
            "startup + exit",
            "of which collector",
            "wall, collector on throughout",
            "heavy modules loaded",
        ],
    )
    total = collecting_total = 0.0
    for stage in STAGES:
        wall = median(lambda r, s=stage: r["plain"][s])
        collecting = median(lambda r, s=stage: r["collecting"][s])
        total += wall
        collecting_total += collecting
        part = {
            k: median(lambda r, s=stage, k=k: r["probed"][s][k]) for k in ("import", "work", "tracking", "collector")
        }
        exit_s = median(lambda r, s=stage: r["probed"][s]["startup_exit"])
        loaded = ", ".join(rounds[-1]["probed"][stage]["loaded"]) or "none of them"
        stages.add(
            f"`batchlab {stage}`",
            f"{wall:.2f}",
            f"{part['import']:.2f}",
            f"{part['work']:.2f}",
            f"{part['tracking']:.2f}",
            f"{exit_s:.2f}",
            f"{part['collector']:.2f}",
            f"{collecting:.2f}",
            loaded,
        )
    stages.add("**all four**", f"**{total:.2f}**", "", "", "", "", "", f"{collecting_total:.2f}", "")
    stages.add(f"import floor: `python -c '{FLOOR}'`", f"{floor:.2f}", "", "", "", "", "", "", "")
    first_total = sum(first["plain"].values())
    stages.add("all four, first run (creates the store)", f"{first_total:.2f}", "", "", "", "", "", "", "")
    ratios = [sum(r["plain"].values()) / r["floor"] for r in rounds]  # each round against its own floor
    targets = Table("Start-up target", ["target", "measured", "result"])
    targets.add(
        f"four stages ≤ {TARGET:g} × import floor ({TARGET * floor:.2f} s)",
        f"{total:.2f} s = {total / floor:.2f} × floor (rounds alone: {min(ratios):.2f}–{max(ratios):.2f}×)",
        verdict(total <= TARGET * floor),
    )
    onnx_table = Table(
        "ONNX export of the default MLP (opset 18), fresh process each: the first call pays the exporter's imports",
        ["exporter", "first call s", "second call s", "graph", "max abs diff vs torch", "parity gate"],
    )
    for name, found in onnx_export.items():
        onnx_table.add(
            f"`dynamo={name == 'dynamo'}` ({name})",
            f"{found['first_s']:.2f}",
            f"{found['second_s']:.3f}",
            " ".join(found["nodes"]),
            f"{found['max_abs_diff']:.1e}",
            "passes" if found["passed"] else "FAILS",
        )
    return {
        "tables": [stages.as_dict(), targets.as_dict(), onnx_table.as_dict()],
        "measured": {
            "rounds": rounds,
            "first_round": first,
            "floor": floor,
            "total": total,
            "total_collecting": collecting_total,
            "onnx": onnx_export,
        },
    }


if __name__ == "__main__":
    print(markdown(main()["tables"]))
