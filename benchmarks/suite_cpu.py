"""Where a command's CPU goes, by program: every process it starts (and every other process that
starts while it runs), sampled every 0.2 s, its CPU seconds at its last sample summed by what it
runs (`batchlab sweep`, a spawned experiment lane, `prefect server`, `dvc repro`, ...).

Run by hand, not by `make bench` (the suite is its usual subject: half an hour):

    .venv/bin/python benchmarks/suite_cpu.py -- make test
    .venv/bin/python benchmarks/suite_cpu.py --out /tmp/ci-cpu.json -- bash .ci/run

It prints a Markdown table (programs by CPU seconds, the processes of each, seconds a process) and
the machine's own CPU seconds over the same wall from /proc/stat, so what the samples miss shows:
a process living under 0.2 s, and a process's last 0.2 s. The sampler itself costs ~5% of one core.
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil

from batchlab import atomic
from common import Table, markdown

INTERVAL_S = 0.2
# the programs a command line is charged to, first match wins; group 1 (when present) names it
KINDS = (
    (r"multiprocessing\.spawn import spawn_main", "experiment lane (spawned process)"),
    (r"--multiprocessing-fork", "forked child"),
    (r"bin/batchlab (\w[\w-]*)", "batchlab {}"),
    (r"-m batchlab\.(\S+)", "python -m batchlab.{}"),
    (r"bin/dvc (\w+)", "dvc {}"),
    (r"bin/prefect server (\w+)", "prefect server {}"),
    (r"uvicorn.*mlflow", "mlflow server (its uvicorn)"),
    (r"uvicorn.*prefect", "prefect server (its uvicorn)"),
    (r"prefect\.engine", "prefect engine"),
    (r"(?:bin/mlflow|-m mlflow) (\w+)", "mlflow {}"),
    (r"gunicorn|huey", "mlflow server worker"),
    (r"bin/dask (\w+)", "dask {}"),
    (r"-c import sys;exec\(eval\(sys\.stdin", "pytest-xdist worker (in-process tests)"),
    (r"-m pytest|bin/pytest", "pytest"),
    (r"-m pip", "pip"),
    (r"bin/(mypy|ruff|hadolint)", "{}"),
    (r"torchrun|torch\.distributed\.run", "torchrun"),
    (r"chrom", "chromium"),
    (r"postgres", "postgres"),
)


def kind(cmd: str, name: str) -> str:
    for pattern, label in KINDS:
        found = re.search(pattern, cmd)
        if found:
            return label.format(*found.groups())
    return f"other: {name}"


def cpu_of_machine() -> float:
    """Seconds of CPU (user, nice, system, irq, softirq) spent so far on every core."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def sample(seen: dict[str, dict[str, Any]], since: float, stop: threading.Event) -> None:
    """Until `stop`: each process started after `since`, its last CPU seconds and its first command
    line (a process exiting reads as a zombie with none)."""
    me = os.getpid()
    while not stop.is_set():
        for proc in psutil.process_iter(["pid", "name", "cmdline", "cpu_times", "create_time"]):
            info = proc.info
            if info["pid"] == me or info["cpu_times"] is None or info["create_time"] < since:
                continue
            row = seen.setdefault(f"{info['pid']}-{info['create_time']}", {"cmd": "", "name": info["name"]})
            row["cmd"] = row["cmd"] or " ".join(info["cmdline"] or [])
            row["cpu"] = info["cpu_times"].user + info["cpu_times"].system
        stop.wait(INTERVAL_S)


def table(seen: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    by_kind: dict[str, list[float]] = defaultdict(list)
    for row in seen.values():
        by_kind[kind(row["cmd"], row["name"])].append(row["cpu"])
    rows = [{"program": k, "cpu_s": sum(v), "processes": len(v)} for k, v in by_kind.items()]
    return sorted(rows, key=lambda r: -r["cpu_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/suite_cpu.json"))
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: give it after --, for example `-- make test`")
    seen: dict[str, dict[str, Any]] = {}
    stop = threading.Event()
    start, machine_before, load = time.time(), cpu_of_machine(), os.getloadavg()
    sampler = threading.Thread(target=sample, args=(seen, start - 1, stop), daemon=True)
    sampler.start()
    rc = subprocess.call(command)
    stop.set()
    sampler.join()
    wall, machine = time.time() - start, cpu_of_machine() - machine_before
    rows = table(seen)
    sampled = sum(r["cpu_s"] for r in rows)
    title = (
        f"`{' '.join(command)}`: exit {rc}, {wall:.0f} s wall, load before {load[0]:.2f} (1 min); "
        f"the machine's CPU {machine:.0f} s on {os.cpu_count()} cores, {sampled:.0f} s of it sampled "
        f"in {len(seen)} processes"
    )
    shown = Table(title, ["program", "CPU s", "share", "processes", "CPU s a process"])
    for r in rows:
        if r["cpu_s"] >= 1:
            shown.add(r["program"], f"{r['cpu_s']:.0f}", f"{r['cpu_s'] / sampled:.1%}", r["processes"],
                      f"{r['cpu_s'] / r['processes']:.2f}")  # fmt: skip
    print(markdown([shown.as_dict()]))
    record = {
        "command": command,
        "exit": rc,
        "wall_s": wall,
        "machine_cpu_s": machine,
        "load_before": load,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "programs": rows,
        "processes": list(seen.values()),
    }
    atomic.write_text(args.out, json.dumps(record))
    return rc


if __name__ == "__main__":
    sys.exit(main())
