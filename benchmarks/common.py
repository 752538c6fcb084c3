"""What every benchmark shares: paths, the CLI environment, the shipped params with overrides, timing,
Markdown tables, and a partial run's earlier rows kept."""

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
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from batchlab.config import Config

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


def keep_earlier(
    bench: str,
    figures_at: str,
    tables: list[Table],
    raw: dict[str, Any],
    key: Callable[[list[str]], str],
    order: Callable[[list[str]], Any],
) -> None:
    """A partial run of `bench` (some of its studies, rules or schedules: BATCHLAB_BENCH_*) keeps
    what it did not measure from RESULTS: each earlier row whose `key(cells)` this run has no figures
    for in `raw`, matched to the table's columns by name (a `measured` column, where the table has
    one, says the date it was measured), and those rows' figures (the result's `field`, by key);
    then every table's rows in `order` (stable: rows of one key keep theirs)."""
    earlier = recorded().get(bench)
    if not earlier:
        return
    kept: dict[str, str] = {}  # key: the date its row was measured
    for table, old in zip(tables, earlier["tables"], strict=True):
        for cells in old["rows"]:
            if key(cells) in raw:
                continue
            row = dict(zip(old["columns"], cells, strict=False))
            kept[key(cells)] = row.get("measured") or earlier["date"][:10]
            table.add(*[row.get(c) or (kept[key(cells)] if c == "measured" else "") for c in table.columns])
        table.rows.sort(key=order)
    dated = any("measured" in table.columns for table in tables)
    for name, measured in kept.items():
        figures = earlier[figures_at].get(name, {})
        raw[name] = {**figures, "measured": measured} if dated else figures


def shipped_params(overrides: dict[str, dict[str, Any]]) -> Config:
    """The repo's params.yaml with each named section's keys replaced (`{"train": {"lr": 0.01}}`):
    the one way a benchmark builds its configs."""
    from batchlab.config import load_config

    base = load_config(REPO / "params.yaml")
    return base.model_copy(update={s: getattr(base, s).model_copy(update=v) for s, v in overrides.items()})


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
