"""Where a run came from: git commit and dirty flag, DVC's data hash, host and torch version."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def git_tags() -> dict[str, str]:
    """The commit, and whether files other than params.yaml and those DVC manages differ from it
    (`batchlab reproduce` rebuilds only a clean run: its commit is all the code it was made from; its
    params are recorded, so `dvc exp run -S` and an edited params.yaml leave a run clean)."""

    def git(*args: str) -> str:  # read only: `git status` must not refresh the user's index (GIT_OPTIONAL_LOCKS)
        env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, timeout=10, env=env).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        changed = [
            line[3:].split(" -> ")[-1] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()
        ]
    except (OSError, subprocess.SubprocessError):
        return {}
    managed = ["params.yaml", *dvc_managed()]  # every param is recorded on the run: reproduce sets them
    dirty = any(not any(path == m or path.startswith(f"{m}/") for m in managed) for path in changed)
    return {"git.commit": commit, "git.dirty": str(dirty).lower()}


def dvc_managed(dvc_yaml: str | Path = "dvc.yaml") -> list[str]:
    """dvc.lock and every output dvc.yaml declares: `dvc repro` rewrites them between stages (the lock,
    the metrics Git tracks), so their changes say nothing about the code a run was made from."""
    import yaml

    path = Path(dvc_yaml)
    if not path.is_file():
        return []
    managed = ["dvc.lock"]
    for stage in ((yaml.safe_load(path.read_text()) or {}).get("stages") or {}).values():
        for kind in ("outs", "metrics", "plots"):
            managed += [next(iter(e)) if isinstance(e, dict) else str(e) for e in stage.get(kind) or []]
    return [m.rstrip("/") for m in managed]


def dvc_data_hash(lock_path: str | Path = "dvc.lock", out: str = "data/prepared") -> str | None:
    import yaml

    path = Path(lock_path)
    if not path.is_file():
        return None
    stage = (yaml.safe_load(path.read_text()) or {}).get("stages", {}).get("generate", {})
    return next((o.get("md5") for o in stage.get("outs", []) if o.get("path") == out), None)


def environment_tags() -> dict[str, str]:
    import torch

    tags = {"host": socket.gethostname(), "torch.version": torch.__version__, **git_tags()}
    data_hash = dvc_data_hash()
    if data_hash:
        tags["dvc.data_hash"] = data_hash
    return tags


def origin() -> str:
    """What started this process, for run names: `dvc exp run` (its experiment's name), `dvc repro`,
    a Prefect flow run (its name), or a plain command."""
    if os.environ.get("DVC_EXP_NAME"):
        return f"exp-{os.environ['DVC_EXP_NAME']}"
    if os.environ.get("DVC_STAGE"):  # DVC sets it for every stage command it runs
        return "dvc"
    if "prefect" in sys.modules:  # imported by a flow; a plain command never pays for prefect
        from prefect.context import FlowRunContext

        context = FlowRunContext.get()
        if context is not None and context.flow_run is not None:
            return f"prefect-{context.flow_run.name}"
    return "cli"
