"""Run the benchmarks, save benchmarks/results.json, print Markdown tables and refresh docs/benchmarks.md.

    python benchmarks/run_all.py                  # every benchmark, one after the other
    python benchmarks/run_all.py --only loop,ddp  # a subset; results of the others are kept

Each benchmark is a module `bench_<name>.py` whose `main()` returns {"tables": [...], ...}.
Nothing is asserted: speed depends on the machine and its neighbours, so the load average
before each benchmark is saved beside its numbers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import os
import platform
import time
from typing import Any

import torch

from batchlab import atomic
from common import REPO, RESULTS, markdown, progress, recorded

BENCHES = (
    "loop",
    "gns",
    "seeds",
    "threads",
    "startup",
    "tracking",
    "team_load",
    "ddp",
    "fsdp",
    "sweep",
    "adaptive",
    "schedules",
    "first_reading",
    "local_cbs",
    "local_cbs_width",
    "dask",
    "repro",
    "chaos",
)
PAGE = REPO / "docs" / "benchmarks.md"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def machine() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def run(names: list[str]) -> dict[str, Any]:
    # a subset run keeps the other benchmarks' last results
    previous = recorded()
    results = {"machine": machine(), "benchmarks": previous}
    for name in names:
        progress(f"== bench_{name}")
        module = importlib.import_module(f"bench_{name}")
        load = os.getloadavg()[0]
        started = time.perf_counter()
        outcome = module.main()
        results["benchmarks"][name] = {
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "seconds": time.perf_counter() - started,
            "load_average_before": load,
            **outcome,
        }
        atomic.write_json(RESULTS, results)  # after each benchmark: a later failure keeps the earlier ones
    return results


def report(results: dict[str, Any]) -> str:
    info = results["machine"]
    parts = [f"_{info['cpu_count']} CPUs, torch {info['torch']}, Python {info['python']}; `make bench` to refresh._"]
    for name in BENCHES:
        bench = results["benchmarks"].get(name)
        if bench:
            when = f"_{bench['date'][:10]}, load average {bench['load_average_before']:.2f} at start_"
            parts.append(f"#### {name}\n\n{when}\n\n{markdown(bench['tables'])}")
    return "\n\n".join(parts)


def update_readme(text: str) -> None:
    content = PAGE.read_text() if PAGE.is_file() else ""
    start, end = content.find(START), content.find(END)
    if start < 0 or end < start:
        print(f"notice: {PAGE.name} has no {START} … {END} section; tables not copied there")
        return
    atomic.write_text(PAGE, f"{content[: start + len(START)]}\n{text}\n{content[end:]}")
    print(f"updated the benchmark section of {PAGE}")


def parse_names(value: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = sorted(set(names) - set(BENCHES))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHES)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", type=parse_names, default=list(BENCHES), help="NAME[,NAME]: " + ", ".join(BENCHES))
    args = parser.parse_args()
    text = report(run(args.only))
    print(text)
    update_readme(text)


if __name__ == "__main__":
    main()
