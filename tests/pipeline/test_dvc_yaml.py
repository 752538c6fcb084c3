"""dvc.yaml tells DVC the truth: every code file a stage runs is one of its deps."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

import batchlab
from tests.support import REPO, TINY, merge, run, write_params

pytestmark = pytest.mark.integration

SRC = Path(batchlab.__file__).resolve().parent

# Runs `batchlab <args>` and records every file of the package whose functions ran (module and
# class bodies, run at import, do not count: importing a file is not depending on it).
TRACER = """
import inspect, json, sys, threading
src, out, args = sys.argv[1], sys.argv[2], sys.argv[3:]
ran = set()
def tracer(frame, event, arg):
    code = frame.f_code
    if code.co_filename.startswith(src) and code.co_flags & inspect.CO_OPTIMIZED:
        ran.add(code.co_filename)
sys.settrace(tracer)
threading.settrace(tracer)
from batchlab.cli import main
try:
    status = main(args)
finally:
    sys.settrace(None)
    json.dump(sorted(ran), open(out, "w"))
sys.exit(status)
"""


def _stages() -> dict[str, dict[str, object]]:
    return dict(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])


def test_every_stage_lists_the_code_it_runs(tmp_path: Path) -> None:
    tracked = {"tracking": {"enabled": True, "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}}
    write_params(tmp_path, merge(TINY, tracked))
    (tmp_path / "tracer.py").write_text(TRACER)
    missing: dict[str, list[str]] = {}
    for name, stage in _stages().items():  # dvc.yaml's order is the pipeline's order
        args = shlex.split(str(stage["cmd"]))
        args = args[args.index("batchlab") + 1 :]
        record = tmp_path / f"{name}.json"
        run(["python", "tracer.py", str(SRC), str(record), *args], tmp_path)
        ran = {f"src/batchlab/{Path(f).relative_to(SRC).as_posix()}" for f in json.loads(record.read_text())}
        deps = [d for d in stage["deps"] if isinstance(d, str)]  # type: ignore[attr-defined]
        uncovered = {f for f in ran if not any(f == d or f.startswith(f"{d}/") for d in deps)}  # a folder covers
        if uncovered:
            missing[name] = sorted(uncovered)
    assert not missing, f"dvc.yaml stages miss the code they run (add these deps): {missing}"


def test_generate_depends_on_the_csv_folder_and_validate_guards_every_stage() -> None:
    stages = _stages()
    assert "data/raw" in stages["generate"]["deps"]  # type: ignore[operator]
    for name, stage in stages.items():
        if name != "validate":
            assert ".batchlab/params.ok" in stage["deps"], name  # type: ignore[operator]


def test_committed_dvc_lock_is_current_with_the_code_and_params(tmp_path: Path) -> None:
    """A fresh clone's `dvc status` may only miss outputs (they live in DVC's cache, not Git);
    a changed code file, param or command means dvc.lock and reports/ were not regenerated."""
    files = run(["git", "ls-files"], REPO).stdout.split()
    for rel in files:
        if (REPO / rel).is_file():
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / rel).write_bytes((REPO / rel).read_bytes())
    run(["git", "init", "-q"], tmp_path)
    status = json.loads(run(["dvc", "status", "--json"], tmp_path).stdout)
    outputs = {
        next(iter(o)) if isinstance(o, dict) else o
        for stage in _stages().values()
        for key in ("outs", "metrics", "plots")
        for o in stage.get(key, [])  # type: ignore[attr-defined]
    }
    stale = set()
    for stage, entries in status.items():
        for entry in entries:  # {"changed deps": {path: state}}, {"changed outs": ...} or "changed command"
            changes = entry.items() if isinstance(entry, dict) else [(entry, {})]
            stale |= {
                f"{stage}: {kind} {path} ({state})"
                for kind, paths in changes
                for path, state in paths.items()
                if not (path in outputs and state in ("deleted", "not in cache"))
            }
            stale |= {f"{stage}: {kind}" for kind, paths in changes if not paths}
    assert not stale, f"dvc.lock is stale: run `make run` and commit dvc.lock and reports/ — {sorted(stale)}"
