"""Wall time of `dvc repro`: the whole pipeline in a clean clone (per stage too), and a no-op repro.

Runs in a throwaway git + DVC copy of the tracked files with the real params.yaml; its
MLflow store (sqlite:///mlflow.db) is created inside the copy, so the first train pays
for the store's creation as a fresh clone would.
"""

from __future__ import annotations

import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import yaml

from common import REPO, Table, cli_env, markdown, progress, run_cli

REPEATS = 3
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "batchlab-bench",
    "GIT_AUTHOR_EMAIL": "bench@batchlab.invalid",
    "GIT_COMMITTER_NAME": "batchlab-bench",
    "GIT_COMMITTER_EMAIL": "bench@batchlab.invalid",
}


def clean_copy(dest: Path) -> None:
    """The repo's tracked files, committed in a new git repo: what `git clone` would give."""
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for rel in listed.splitlines():
        if (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "bench"]):
        run_cli(cmd, dest, **GIT_IDENTITY)


def full_repro(repo: Path) -> tuple[float, dict[str, float]]:
    """`dvc repro`, timing each stage from DVC's "Running stage" line to the next (or the end)."""
    marks: list[tuple[str, float]] = []
    tail: deque[str] = deque(maxlen=40)
    started = time.perf_counter()
    cmd = ["dvc", "repro"]
    # unbuffered, so each line arrives when DVC writes it and its timestamp is the stage's start
    env = cli_env(PYTHONUNBUFFERED="1")
    with subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout or []:
            tail.append(line)
            if match := re.match(r"Running stage '([^']+)'", line):
                marks.append((match[1], time.perf_counter()))
    ended = time.perf_counter()
    if proc.returncode != 0:
        raise RuntimeError(f"dvc repro exited {proc.returncode}\n{''.join(tail)}")
    ends = [at for _, at in marks[1:]] + [ended]
    return ended - started, {stage: end - at for (stage, at), end in zip(marks, ends, strict=True)}


def main() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        clean_copy(repo)
        progress("repro: full dvc repro from a clean clone")
        full, per_stage = full_repro(repo)
        progress("repro: no-op dvc repro")
        noop = [run_cli(["dvc", "repro"], repo) for _ in range(REPEATS)]

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    table = Table(
        f"`dvc repro` at the real params ({params['data']['samples']} rows, {params['train']['epochs']} epochs, "
        f"tracking {'on' if params['tracking']['enabled'] else 'off'})",
        ["run", "wall s"],
    )
    table.add("full, clean clone (creates the MLflow store)", f"{full:.1f}")
    table.add(f"no-op, nothing changed (median of {REPEATS})", f"{statistics.median(noop):.2f}")
    for stage, seconds in per_stage.items():
        table.add(f"… stage {stage}", f"{seconds:.1f}")
    measured = {"full_s": full, "noop_s": noop, "stage_s": per_stage}
    return {"tables": [table.as_dict()], "measured": measured}


if __name__ == "__main__":
    print(markdown(main()["tables"]))
