"""`batchlab reproduce RUN_ID`: rebuild a tracked run from its record and compare what comes out.

The run's record holds everything it was made from: the git commit (refused when code was uncommitted;
an edited params.yaml is not: `dvc exp run -S` edits it, and the run records every param), every
param, and DVC's hash of the prepared data. The rebuild happens in a temporary git worktree at that
commit, with the run's params and this repo's DVC cache (`dvc pull` first when a remote is set):
`dvc repro generate`, then train and evaluate forced (no run-cache: they really run). It compares the
data hash, the test metrics, the last epoch's training metrics and every weight tensor.
"""

from __future__ import annotations

import ast
import csv
import json
import logging
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from batchlab.config import ConfigError, parse_config
from batchlab.data import DataError
from batchlab.tracking.record import RunRecord

log = logging.getLogger(__name__)

# per-epoch figures that measure the machine, not the model
MACHINE_METRICS = {
    "samples_per_s",
    "epoch_seconds",
    "samples_per_s_group_share",
    "epoch_seconds_group_share",
    "peak_memory_mb",
}


class CannotReproduce(DataError):
    """A run its record cannot rebuild (dirty tree, no commit); one line, exit 2."""


class Differs(RuntimeError):
    """The rebuild differs from the record (the table printed before says where); exit 1."""


@dataclass(frozen=True)
class Row:
    what: str
    recorded: str
    reproduced: str
    same: bool


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def _value(text: str) -> Any:
    """A param as MLflow holds it (str(value)) back to a value the config validates: a Python
    literal first (a list of floats such as [0.0002, 5e-07] is one; YAML reads 5e-07 as a string),
    else YAML (a bare word)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return yaml.safe_load(text)


def rebuild_params(record: RunRecord, committed: str) -> str:
    """params.yaml for the rebuild: the commit's file with every recorded value, tracking off."""
    raw = yaml.safe_load(committed) or {}
    for key, text in record.params.items():
        section, _, name = key.partition(".")
        if section != "tracking" and isinstance(raw.get(section), dict):
            raw[section][name] = _value(text)
    raw.setdefault("tracking", {})["enabled"] = False  # the rebuild opens no run in anyone's store
    try:
        cfg = parse_config(raw)
    except ConfigError as err:
        raise CannotReproduce(f"run {record.run_id}: its params do not load at its commit: {err}") from None
    differ = [k for k, v in cfg.flat().items() if not k.startswith("tracking.") and record.params.get(k) != str(v)]
    if differ:
        raise CannotReproduce(
            f"run {record.run_id}: params {differ} were not recorded as its commit's config reads them"
        )
    return yaml.safe_dump(raw, sort_keys=False)


def check_record(record: RunRecord, repo: Path) -> str:
    """The commit to rebuild from; CannotReproduce when there is none or the tree was dirty."""
    commit = record.tags.get("git.commit")
    if not commit:
        raise CannotReproduce(f"run {record.run_id} has no git.commit tag (made outside a git repo?)")
    if record.tags.get("git.dirty") != "false":
        raise CannotReproduce(f"run {record.run_id} was made from a dirty tree (uncommitted changes at {commit[:12]}); "
                              "no commit holds its code")
    try:
        _git(repo, "cat-file", "-e", f"{commit}^{{commit}}")
    except subprocess.CalledProcessError:
        raise CannotReproduce(
            f"run {record.run_id}: commit {commit[:12]} is not in this repository (git fetch?)"
        ) from None
    return commit


PREFIX = "batchlab-reproduce-"  # the temporary folder of each rebuild: tree/ and OWNER
OWNER = "owner"  # "<pid> <host>" of the reproduce that made the folder


def _remove_tree(repo: Path, tree: Path) -> None:
    subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], capture_output=True)
    shutil.rmtree(tree.parent, ignore_errors=True)
    subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True)


def _owner_gone(folder: Path) -> bool:
    """Whether the reproduce that made `folder` no longer runs on this host (no owner file: killed
    before it wrote one, or made by a batchlab without them)."""
    try:
        pid, host = (folder / OWNER).read_text().split()
        os.kill(int(pid), 0)
    except (OSError, ValueError):  # no file, a damaged one, or no such process
        return True
    return host != socket.gethostname()


def clean_leftovers(repo: Path) -> list[Path]:
    """The worktrees an interrupted (SIGKILLed) reproduce left, with the `dvc repro` and training
    processes still running in them: stopped and removed; return the trees."""
    import psutil

    listed = _git(repo, "worktree", "list", "--porcelain").splitlines()
    trees = [Path(line.removeprefix("worktree ")) for line in listed if line.startswith("worktree ")]
    stale = [t for t in trees if t.name == "tree" and t.parent.name.startswith(PREFIX) and _owner_gone(t.parent)]
    for tree in stale:
        for proc in psutil.process_iter(["cwd"]):
            cwd = proc.info["cwd"]
            if cwd and Path(cwd).is_relative_to(tree):
                with suppress(psutil.Error):
                    proc.kill()
        _remove_tree(repo, tree)
        log.warning("reproduce: removed %s, left by an interrupted reproduce, and stopped what ran in it", tree)
    return stale


@contextmanager
def worktree(repo: Path, commit: str) -> Iterator[Path]:
    """A detached git worktree at `commit`, removed afterwards (or by the next reproduce, when this
    one is killed before it can: clean_leftovers)."""
    tmp = Path(tempfile.mkdtemp(prefix=PREFIX))
    (tmp / OWNER).write_text(f"{os.getpid()} {socket.gethostname()}")
    tree = tmp / "tree"
    _git(repo, "worktree", "add", "--detach", "--quiet", str(tree), commit)
    try:
        yield tree
    finally:
        _remove_tree(repo, tree)


def _environment(tree: Path) -> dict[str, str]:
    """The commit's code (its src/ first on the import path) with this interpreter's tools."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI" and not k.startswith("DVC_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree / "src"), env.get("PYTHONPATH")) if p)
    return env


def _run(tree: Path, *cmd: str, check: bool = True) -> bool:
    log.info("reproduce: %s", " ".join(cmd))
    proc = subprocess.run(list(cmd), cwd=tree, env=_environment(tree), capture_output=True, text=True)
    if check and proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise RuntimeError(f"reproduce: `{' '.join(cmd)}` failed in the worktree at {tree}: {last}")
    return proc.returncode == 0


def rebuild(tree: Path, repo: Path, params: str) -> None:
    """Data from DVC (remote or the shared cache; generate reruns when neither has it), then train and evaluate."""
    from dvc.repo import Repo

    with Repo(str(repo)) as dvc:
        cache_dir, remotes = dvc.cache.local_cache_dir, dict(dvc.config["remote"])
    (tree / "params.yaml").write_text(params)
    _run(tree, "dvc", "cache", "dir", "--local", str(cache_dir))
    if remotes:  # best effort: what the remote lacks, the cache or generate provides
        _run(tree, "dvc", "pull", "--allow-missing", "generate", check=False)
    _run(tree, "dvc", "repro", "generate")
    for stage in ("train", "evaluate"):  # --force: run, not restored from the run-cache
        _run(tree, "dvc", "repro", "--force", "--single-item", stage)


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def compare(record: RunRecord, tree: Path, weights: dict[str, Any] | None) -> list[Row]:
    import torch

    from batchlab.audit.verify import dir_hash, md5

    rows = []
    data = tree / "data" / "prepared"
    recorded_hash = record.tags.get("dvc.data_hash")
    data_hash = dir_hash({p.relative_to(data).as_posix(): md5(p) for p in sorted(data.rglob("*")) if p.is_file()})
    rows.append(
        Row("data hash (data/prepared)", recorded_hash or "not recorded", data_hash, recorded_hash in (None, data_hash))
    )
    metrics = {f"test_{k}": v for k, v in json.loads((tree / "reports/metrics.json").read_text()).items()}
    with (tree / "reports/history.csv").open(newline="") as f:
        last_epoch = list(csv.DictReader(f))[-1]
    metrics |= {k: float(v) for k, v in last_epoch.items() if k != "epoch" and k not in MACHINE_METRICS}
    for key in sorted(metrics.keys() & record.metrics.keys()):
        old, new = record.metrics[key], metrics[key]
        rows.append(Row(key, repr(old), repr(new), _same(old, new)))
    new_weights = torch.load(tree / "models/model.pt", map_location="cpu", weights_only=True)["state_dict"]
    if weights is None:
        rows.append(Row("weights", "not recorded as a torch.export model", "-", True))
        return rows
    for name in sorted(weights.keys() | new_weights.keys()):
        a, b = weights.get(name), new_weights.get(name)
        if a is None or b is None or a.shape != b.shape:
            shapes = [tuple(t.shape) if t is not None else "missing" for t in (a, b)]
            rows.append(Row(f"weights {name}", str(shapes[0]), str(shapes[1]), False))
        else:
            diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
            shown = "identical" if torch.equal(a, b) else f"max |diff| {diff:.3g}"
            rows.append(Row(f"weights {name}", f"{tuple(a.shape)}", shown, bool(torch.equal(a, b))))
    return rows


def verdict(record: RunRecord, commit: str, rows: list[Row]) -> str:
    differ = [r for r in rows if not r.same]
    head = f"reproduce: run {record.run_id} at {commit[:12]}:"
    if not differ:
        return f"{head} identical ({len(rows)} values: data hash, metrics, weights)"
    table = ["| what | recorded | reproduced |", "|---|---|---|"]
    table += [f"| {r.what} | {r.recorded} | {r.reproduced} |" for r in differ]
    return "\n".join([f"{head} {len(differ)} of {len(rows)} values differ", *table])


def reproduce(run_id: str, tracking_uri: str, repo: Path = Path(".")) -> tuple[str, bool]:
    """Rebuild run `run_id` and compare: the verdict text, and whether everything is identical."""
    from batchlab.tracking.backend import preflight
    from batchlab.tracking.record import run_record, torch_weights

    repo = Path(_git(repo, "rev-parse", "--show-toplevel").strip())
    clean_leftovers(repo)
    preflight(tracking_uri)
    record = run_record(run_id, tracking_uri)
    commit = check_record(record, repo)
    try:
        committed = _git(repo, "show", f"{commit}:params.yaml")
    except subprocess.CalledProcessError:
        raise CannotReproduce(f"run {run_id}: commit {commit[:12]} has no params.yaml") from None
    params = rebuild_params(record, committed)
    weights = torch_weights(record, tracking_uri)
    with worktree(repo, commit) as tree:
        rebuild(tree, repo, params)
        rows = compare(record, tree, weights)
    return verdict(record, commit, rows), all(r.same for r in rows)
