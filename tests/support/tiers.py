"""The suite's tiers, their guard, the order tests are handed out in, and what CI is told.

- `unit`: every test with no tier marker. In-process only: no subprocess, no repo copy, no server.
- `integration`: CLI and dvc/git processes, repo copies, SQLite MLflow, in-process tracked pipelines.
- `e2e`: real servers, DDP/FSDP ranks, the browser, the README's examples, load and fault tests.

Both marked tiers also count as `slow`, so `make test-fast` (`-m "not slow"`) is the unit tier. The
guard fails a unit test that takes a fixture of the marked tiers (at collection) or starts a
process (at its end, naming the command), so the fast lane stays free of process starts.
"""

from __future__ import annotations

import ast
import functools
import json
import multiprocessing.util
import os
import resource
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

TIERS = ("unit", "integration", "e2e")
# each tier's summed test time, over both workers, that keeps `.ci/run` (set-up included) inside 20
# minutes on this machine's 2 cores: the summary warns when a tier passes it (a warning, not a
# failure: timings move with the load), so growth shows in the landing that causes it
BUDGET_S = {"unit": 200.0, "integration": 900.0, "e2e": 1100.0}
DURATIONS = Path(__file__).resolve().parents[1] / "durations.json"
UNKNOWN_S = 1.0  # a test with no recorded duration is handed out as a 1 s one

# fixtures that copy the repo, start a process or a server: a test that takes one is not a unit test
PROCESS_FIXTURES = frozenset(
    {"repo_copy", "after_make_run", "pipeline", "server", "setup", "cluster", "repo", "mlflow_server"}
)


def tier_of(item: pytest.Item) -> str:
    marked = [tier for tier in ("e2e", "integration") if item.get_closest_marker(tier)]
    return marked[0] if marked else "unit"


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects: the tiers add `slow` here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    problems = []
    for item in items:
        tier = tier_of(item)
        if tier != "unit":
            item.add_marker(pytest.mark.slow)
            continue
        if item.get_closest_marker("slow"):
            problems.append(f"{item.nodeid}: marked slow without a tier: mark it integration or e2e")
        taken = sorted(PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())))
        if taken:
            problems.append(f"{item.nodeid}: a unit test takes {', '.join(taken)}: mark it integration or e2e")
    if problems:
        raise pytest.UsageError("tier guard:\n  " + "\n  ".join(problems))
    items[:] = longest_first(items, _recorded())


def _recorded(path: Path = DURATIONS) -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError):
        return {}


def longest_first(items: list[pytest.Item], durations: dict[str, float]) -> list[pytest.Item]:
    """Whole work units (a test, or the tests sharing a module-scoped fixture) by their recorded
    seconds, longest first: the last test handed out is short, so no worker idles while the other
    finishes a 5-minute one."""
    unit_s: dict[str, float] = {}
    for item in items:
        unit = work_unit(item.nodeid, item.config.rootpath)
        unit_s[unit] = unit_s.get(unit, 0.0) + recorded_seconds(item.nodeid, durations)
    order = {item.nodeid: i for i, item in enumerate(items)}
    return sorted(items, key=lambda it: (-unit_s[work_unit(it.nodeid, it.config.rootpath)], order[it.nodeid]))


def recorded_seconds(nodeid: str, durations: dict[str, float]) -> float:
    """A test's recorded seconds; for a parameter never recorded (the chaos test's schedule, which
    the commit picks), the mean of the same test's recorded parameters; else UNKNOWN_S."""
    if nodeid in durations:
        return durations[nodeid]
    base = nodeid.split("[", 1)[0]
    siblings = [v for k, v in durations.items() if "[" in nodeid and k.split("[", 1)[0] == base]
    return sum(siblings) / len(siblings) if siblings else UNKNOWN_S


@functools.cache
def _shared_fixture_users(module: Path) -> frozenset[str]:
    """The test functions of `module` that take a module- or class-scoped fixture it defines (its
    source read, not imported)."""
    try:
        tree = ast.parse(module.read_text())
    except (OSError, SyntaxError):
        return frozenset()
    shared: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for deco in node.decorator_list:
                call = deco if isinstance(deco, ast.Call) else None
                scopes = [kw.value for kw in call.keywords if kw.arg == "scope"] if call else []
                if any(isinstance(s, ast.Constant) and s.value in ("module", "class") for s in scopes):
                    shared.add(node.name)
    tests = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
    return frozenset(n.name for n in tests if shared & {a.arg for a in n.args.args})


def work_unit(nodeid: str, root: Path) -> str:
    """The tests that must run on one worker: those taking one module's shared fixtures, so the
    fixture is built once; any other test is its own unit."""
    module, _, rest = nodeid.partition("::")
    function = rest.split("::")[-1].split("[")[0]
    return module if function in _shared_fixture_users(root / module) else nodeid


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without the plugin nothing calls it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`-n N` hands out work units (`work_unit`) in collection order, which is longest first."""
    if config.getvalue("dist") != "load":
        return None  # another --dist asked for by name
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # xdist would put the units with the most tests first

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid, config.rootpath)

    return SharedFixtureScheduling(config, log)


# ---- the runtime half of the guard: a unit test that starts a process fails, naming it


@contextmanager
def processes_started() -> Iterator[list[str]]:
    """The processes started in the block, as command lines: every way this process starts
    another (subprocess, fork, posix_spawn, os.system, multiprocessing's spawn and forkserver)
    is wrapped to note it first. They still start."""
    started: list[str] = []
    popen_execute = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def execute_child(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> Any:
        started.append(" ".join(map(str, args)) if isinstance(args, list | tuple) else str(args))
        return popen_execute(self, args, *rest, **kw)

    def wrap(owner: Any, name: str) -> Callable[[], None]:
        original = getattr(owner, name)

        def noted(*args: Any, **kw: Any) -> Any:
            started.append(f"{owner.__name__}.{name}{tuple(map(str, args))[:2]}")
            return original(*args, **kw)

        setattr(owner, name, noted)
        return lambda: setattr(owner, name, original)

    subprocess.Popen._execute_child = execute_child  # type: ignore[attr-defined]
    undo = [wrap(os, name) for name in ("fork", "posix_spawn", "posix_spawnp", "system")]
    undo.append(wrap(multiprocessing.util, "spawnv_passfds"))
    try:
        yield started
    finally:
        for restore in reversed(undo):
            restore()
        subprocess.Popen._execute_child = popen_execute  # type: ignore[attr-defined]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    if tier_of(item) != "unit":
        return (yield)
    with processes_started() as started:
        result = yield
    if started:
        shown = "; ".join(c[:160] for c in started[:3])
        pytest.fail(f"tier guard: a unit test started {len(started)} process(es) ({shown}): mark it integration or e2e")
    return result


# ---- what CI is told: load and cores at start and end, seconds and CPU-seconds per tier, the
# recorded durations

# A test's CPU-seconds: its own process's and those of the processes it started and reaped (servers
# stopped, commands run), from its setup to its teardown. On 2 cores with a worker more than cores,
# test time stretches with the load and CPU-seconds hardly do: they say where the wall goes. A module's
# servers count where they are stopped (its last test); PostgreSQL's work and processes nobody reaps
# (an orphaned grandchild) count nowhere.
_CPU_AT = pytest.StashKey[float]()


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)  # before the fixtures are set up
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_CPU_AT] = cpu_seconds()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """The teardown report carries the test's CPU-seconds (its user_properties travel to the
    pytest-xdist controller with it)."""
    if call.when == "teardown" and _CPU_AT in item.stash:
        item.user_properties.append(("cpu_s", cpu_seconds() - item.stash[_CPU_AT]))
    return (yield)


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores"


class _Summary:
    """One session's figures (an in-process pytester run is a session of its own, with its own)."""

    def __init__(self) -> None:
        self.started, self.load = time.monotonic(), _load()
        self.seconds = {t: 0.0 for t in TIERS}
        self.cpu = {t: 0.0 for t in TIERS}
        self.counts = {t: 0 for t in TIERS}
        self.durations: dict[str, float] = {}
        self.cpu_by_test: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """On the controller too: pytest-xdist replays each worker's reports there."""
        keywords = getattr(report, "keywords", {})
        tier = "e2e" if "e2e" in keywords else "integration" if "integration" in keywords else "unit"
        self.seconds[tier] += report.duration
        if report.when == "call":
            self.counts[tier] += 1
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration
        cpu = dict(report.user_properties).get("cpu_s") if report.when == "teardown" else None
        if isinstance(cpu, float):
            self.cpu[tier] += cpu
            self.cpu_by_test[report.nodeid] = cpu

    def pytest_terminal_summary(self, terminalreporter: Any, config: pytest.Config) -> None:
        if hasattr(config, "workerinput"):
            return
        write = terminalreporter.write_line
        write(f"batchlab tiers: {time.monotonic() - self.started:.0f} s wall; at start {self.load}; at end {_load()}")
        for tier in TIERS:
            if self.counts[tier]:
                used, budget = self.seconds[tier], BUDGET_S[tier]
                told = f"{used:7.0f} s of test time (budget {budget:.0f} s), {self.cpu[tier]:.0f} CPU-seconds"
                write(f"  {tier:<12} {self.counts[tier]:4d} tests  {told}")
                if used > budget:
                    write(
                        f"  WARNING: the {tier} tier took {used:.0f} s of test time, over its budget of {budget:.0f} s "
                        "(tests/support/tiers.py BUDGET_S): the slowest below are where it went",
                        yellow=True,
                    )
        heaviest = sorted(self.cpu_by_test.items(), key=lambda kv: -kv[1])[:10]
        if heaviest:
            write("  the most CPU-seconds (a test's and its processes', setup to teardown):")
            for nodeid, cpu in heaviest:
                write(f"  {cpu:7.1f}  {nodeid}")
        out = os.environ.get("BATCHLAB_DURATIONS_OUT")
        if out:  # `make test-durations`: merge this run's figures into the file's (or the recorded ones)
            path = Path(out)
            merged = {**_recorded(path if path.exists() else DURATIONS), **self.durations}
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps({k: round(v, 2) for k, v in sorted(merged.items())}, indent=0) + "\n")
            tmp.replace(path)
            write(f"  durations of {len(self.durations)} tests merged into {out}")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_Summary(), f"batchlab-tiers-summary-{id(config)}")


def pytest_report_header(config: pytest.Config) -> str:
    return f"batchlab tiers: {', '.join(TIERS)}; at start: {_load()}"
