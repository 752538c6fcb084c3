"""What every benchmark shares: paths, the CLI environment, timing and Markdown tables."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results.json"
BIN = Path(sys.executable).parent  # the venv that runs the benchmark also provides `batchlab` and `dvc`


def cli_env(**extra: str) -> dict[str, str]:
    """Environment for `batchlab` / `dvc` subprocesses: venv on PATH, quiet logs, the params file decides tracking."""
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)  # a user's server must not receive benchmark runs
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(BATCHLAB_LOG="WARNING", DVC_NO_ANALYTICS="1", PREFECT_SERVER_ANALYTICS_ENABLED="false", **extra)
    return env


def run_cli(cmd: list[str], cwd: Path, **extra: str) -> float:
    """Run a command to completion and return its wall time; raise with the output tail if it fails."""
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=cli_env(**extra), capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return seconds


def timed(call: Callable[[], T]) -> tuple[T, float]:
    started = time.perf_counter()
    result = call()
    return result, time.perf_counter() - started


@contextlib.contextmanager
def working_dir(path: Path) -> Iterator[None]:
    previous = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def recorded() -> dict[str, Any]:
    """Each benchmark's last saved result in RESULTS, by name ({} before the first run)."""
    return json.loads(RESULTS.read_text()).get("benchmarks", {}) if RESULTS.is_file() else {}


def verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def median_interval(values: list[float], coverage: float = 0.95) -> tuple[float, float, float, float]:
    """The median of `values` and its distribution-free interval from order statistics: trimming k
    values from each end, [x_(k+1), x_(n-k)] covers the median with 1 - 2·P(Bin(n, ½) ≤ k); k is the
    largest trim that keeps `coverage` (0 where even the full range falls short: its own coverage is
    returned). Returns (median, low, high, the interval's coverage)."""
    from scipy.stats import binom

    ordered, n = sorted(values), len(values)
    covers = [1 - 2 * float(binom.cdf(k, n, 0.5)) for k in range((n + 1) // 2)]
    k = max([k for k, c in enumerate(covers) if c >= coverage], default=0)
    mid = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return mid, ordered[k], ordered[n - 1 - k], covers[k]


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class Table:
    """A titled table of preformatted cells; the raw numbers live beside it in the result dict."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def add(self, *cells: object) -> None:
        self.rows.append([str(c) for c in cells])

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def markdown(tables: list[dict[str, Any]]) -> str:
    """Tables (as stored in a result dict) as Markdown, one titled block each."""
    blocks = []
    for table in tables:
        lines = [f"**{table['title']}**", "", "| " + " | ".join(table["columns"]) + " |"]
        lines.append("|" + "|".join("---" for _ in table["columns"]) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in table["rows"]]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
