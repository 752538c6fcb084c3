"""The README's promise: every command it and the docs show works exactly as written after `make run`.

The commands are parsed from README.md and docs/*.md, so the test and the docs cannot drift apart:
a new command is run here, or listed in NOT_RUN with the test that covers it instead.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO, copy_repo, env_with_venv, refresh_git_index

# prefix of a README command -> why this test does not run it, and what covers it instead
NOT_RUN = {
    "make run": "this test's first step runs what it runs (`.venv/bin/dvc repro`) in a copy of the repo",
    "make test": "CI runs it",
    "make ui": "serves until stopped",
    "make serve": "serves until stopped; tests/orchestration/test_schedule.py serves the deployments",
    "createdb": "needs PostgreSQL: test_tracking.py::test_pipeline_logs_to_an_mlflow_server_on_postgresql",
    ".venv/bin/mlflow server": "serves until stopped: tests/tracking/test_tracking.py starts one on PostgreSQL",
    "export MLFLOW_TRACKING_URI": "test_tracking.py::test_pipeline_logs_to_an_mlflow_server_on_postgresql",
    "PREFECT_SERVER_ANALYTICS_ENABLED=false .venv/bin/prefect server start": "serves until stopped",
    "PREFECT_API_DATABASE_CONNECTION_URL=": "serves until stopped",
    "PREFECT_API_URL=": "serves until stopped; tests/orchestration/test_schedule.py",
    ".venv/bin/dvc exp run -S train.strategy=ddp -S train.nnodes=2": "two machines: test_ddp.py two launchers",
    ".venv/bin/dvc exp run -S train.strategy=ddp -S train.nproc=2": "tests/pipeline/test_dvc_matrix.py runs DDP "
    "(bf16, accumulation) through dvc repro on tiny params",
    ".venv/bin/dvc exp run -S train.strategy=fsdp -S train.nproc=2": "tests/pipeline/test_dvc_matrix.py (fp16)",
    ".venv/bin/dvc exp run -S train.precision=bf16": "tests/pipeline/test_dvc_matrix.py (with DDP)",
    ".venv/bin/dvc exp run --queue": "runs in the background: tests/pipeline/test_dvc_queue.py runs a queued grid",
    'PATH="$PWD/.venv/bin:$PATH" .venv/bin/dvc queue start': "runs in the background: tests/pipeline/test_dvc_queue.py",
    ".venv/bin/batchlab --params params-node1.yaml": "two machines: tests/training/test_ddp.py two launchers",
    "python3 -m venv": "GPU set-up (CUDA wheels come from the network)",
    ".venv/bin/pip install --index-url": "GPU set-up (CUDA wheels come from the network)",
    "docker": "no Docker engine on this machine",
    "make docker-check": "builds the image and runs the pipeline in it (~15 min): tests/pipeline/test_docker_check.py, "
    "with BATCHLAB_DOCKER_CHECK=1",
    "BATCHLAB_DOCKER_CHECK=1": "tests/pipeline/test_docker_check.py itself, opt-in (~15 min)",
    ".venv/bin/batchlab reproduce": "needs a run id from a clean commit: tests/audit/test_reproduce.py",
    ".venv/bin/batchlab predict --model models:/": "a registry `make run` may restore from DVC's cache without "
    "registering: tests/inference/test_predict.py::test_mlflow_uris_name_the_same_model",
    'PATH="$PWD/.venv/bin:$PATH" .venv/bin/mlflow models serve': "serves until stopped: test_predict.py",
    ".venv/bin/dask scheduler": "serves until stopped: tests/sweep/test_dask_sweep.py starts one",
    "DASK_DISTRIBUTED__WORKER__DAEMON=False": "serves until stopped: tests/sweep/test_dask_sweep.py starts two workers",
    ".venv/bin/dvc remote add": "S3/SSH need accounts; a directory remote: tests/pipeline/test_dvc_remote.py",
    ".venv/bin/dvc push --run-cache": "tests/pipeline/test_dvc_remote.py",
    ".venv/bin/dvc pull --run-cache": "another clone: tests/pipeline/test_dvc_remote.py",
    ".venv/bin/dvc exp push": "needs a Git remote: tests/pipeline/test_dvc_remote.py",
    ".venv/bin/dvc exp pull": "needs a Git remote: tests/pipeline/test_dvc_remote.py",
}


def readme_commands(text: str) -> list[str]:
    """Every command line of the README's ```bash blocks, comments dropped, `\\` lines joined."""
    commands: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s+#.*$", "", line).strip()
            if command and not command.startswith("#"):
                commands.append(" ".join(command.split()))
    return commands


PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _pages_text() -> str:
    return "\n".join(page.read_text() for page in PAGES)


def _runnable() -> list[str]:
    """Each command once, in the order the README and then the docs show them."""
    commands = readme_commands(_pages_text())
    return [c for c in dict.fromkeys(commands) if not c.startswith(tuple(NOT_RUN))]


def test_readme_commands_are_parsed_and_each_one_is_run_or_accounted_for() -> None:
    runnable = _runnable()
    assert ".venv/bin/dvc metrics show" in runnable and len(runnable) >= 6, runnable


def _plain_shell_env() -> dict[str, str]:
    """A user's shell: the venv is NOT on PATH and Prefect's analytics are at their default."""
    env = env_with_venv()
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != venv_bin)
    for key in ("PREFECT_SERVER_ANALYTICS_ENABLED", "VIRTUAL_ENV", "PREFECT_API_URL", "PREFECT_HOME"):
        env.pop(key, None)
    return env


def _groups() -> dict[str, list[str]]:
    """The runnable commands in independent groups, each run in its own copy of the built repo:
    every `dvc exp run` line alone (each changes params and reruns stages), the Prefect flows
    together, and the rest (reads of what `make run` built) in the order the pages show them."""
    groups: dict[str, list[str]] = {"after-make-run": []}
    for command in _runnable():
        if command.startswith(".venv/bin/dvc exp run"):
            settings = [s.split("=")[0].split(".")[-1] for s in command.split(" -S ")[1:]]
            groups[f"exp-{'-'.join(settings)}"] = [command]
        elif command.startswith(".venv/bin/python flows/"):
            groups.setdefault("flows", []).append(command)
        else:
            groups["after-make-run"].append(command)
    return groups


def _run_as_a_user(command: str, repo: Path, env: dict[str, str]) -> None:
    proc = subprocess.run(["bash", "-c", command], cwd=repo, env=env, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"`{command}` exited {proc.returncode}:\n{output[-4000:]}"
    assert "Traceback" not in output, f"`{command}` printed a traceback:\n{output[-4000:]}"
    if command.startswith((".venv/bin/dvc repro", ".venv/bin/dvc exp run")):  # DVC left nothing to do
        status = subprocess.run([".venv/bin/dvc", "status"], cwd=repo, env=env, capture_output=True)
        assert b"Data and pipelines are up to date" in status.stdout, (command, status.stdout)


@pytest.fixture(scope="session")
def after_make_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the repo after `.venv/bin/dvc repro` (what `make run` runs), built once for every
    test process: the first to need it builds it under a file lock, the others copy it."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent  # one folder for all pytest-xdist workers
    built = shared / "readme-after-make-run"
    with FileLock(str(shared / "readme-after-make-run.lock")):
        if not (built / ".built").exists():
            shutil.rmtree(built, ignore_errors=True)
            copy_repo(built)
            (built / ".venv").symlink_to(sys.prefix)  # what `make run` creates
            (shared / "readme-home").mkdir(exist_ok=True)
            env = {**_plain_shell_env(), "HOME": str(shared / "readme-home")}
            _run_as_a_user(".venv/bin/dvc repro", built, env)
            (built / ".built").touch()
    return built


@pytest.mark.e2e
@pytest.mark.parametrize("group", list(_groups()))
def test_every_readme_command_works_as_written_after_make_run(group: str, after_make_run: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(after_make_run, repo, symlinks=True, ignore=shutil.ignore_patterns(".built"))
    refresh_git_index(repo)
    home = tmp_path / "home"  # a user's own, as yet without ~/.prefect
    home.mkdir()
    env = {**_plain_shell_env(), "HOME": str(home)}
    for command in _groups()[group]:
        _run_as_a_user(command, repo, env)


def test_every_test_the_readme_names_exists() -> None:
    """The fault table names the test that proves each row: a renamed test must not leave it stale."""
    named = set(re.findall(r"(test_\w+\.py)::(test_\w+)", _pages_text()))
    assert len(named) >= 20, named
    files = {path.name: path for path in (REPO / "tests").rglob("test_*.py")}  # tests/<concern>/test_x.py
    missing = [f"{f}::{t}" for f, t in sorted(named) if f not in files or f"def {t}(" not in files[f].read_text()]
    assert not missing, f"README names tests that do not exist: {missing}"


@pytest.mark.e2e
def test_the_default_studys_recommendation_is_beaten_by_no_batch_size(after_make_run: Path) -> None:
    """`make run`'s study, recomputed from its experiments' result.json rows with scipy alone: no
    batch size beats the recommended one (paired t-tests by seed, Holm over every pair, by adjusted
    p-values), and the verdict's first line states its speed-up and F1 difference against the best."""
    import json
    import statistics

    from scipy import stats

    from batchlab import atomic

    table = {int(r["batch_size"]): r for r in atomic.read_csv(after_make_run / "reports/sweep/summary.csv")}
    f1: dict[int, dict[int, float]] = {b: {} for b in table}
    for path in (after_make_run / "sweep/experiments").glob("*/result.json"):
        row = json.loads(path.read_text())
        if not row.get("adaptive") and row["lr"] == pytest.approx(float(table[row["batch_size"]]["lr"])):
            f1[row["batch_size"]][row["seed"]] = row["test_f1_macro"]
    batches, seeds = sorted(f1), min(len(by_seed) for by_seed in f1.values())
    figures = json.loads((after_make_run / "reports/sweep/sweep.json").read_text())
    chosen, best = figures["recommended_batch_size"], figures["best_f1_batch_size"]
    mean = {b: statistics.fmean(f1[b].values()) for b in batches}
    assert best == max(batches, key=mean.__getitem__)
    if seeds >= 2:  # one seed (the tiny params' study): no test, nothing is beaten
        p = {(a, b): stats.ttest_rel([f1[a][s] for s in sorted(f1[a])], [f1[b][s] for s in sorted(f1[a])]).pvalue
             for i, a in enumerate(batches) for b in batches[i + 1 :]}  # fmt: skip
        adjusted, running = {}, 0.0
        for j, key in enumerate(sorted(p, key=p.__getitem__)):
            running = max(running, min(1.0, (len(p) - j) * p[key]))
            adjusted[key] = running
        beaten_by = [a for a in batches if a != chosen and mean[a] > mean[chosen]
                     and adjusted[tuple(sorted((a, chosen)))] <= 0.05]  # fmt: skip
        assert not beaten_by, f"batch {chosen} is measurably worse than {beaten_by}"
    first = (after_make_run / "reports/sweep/summary.md").read_text().split("## Verdict\n\n", 1)[1].splitlines()[0]
    assert first.startswith(f"Recommended: batch {chosen}, ")
    if chosen != best:
        diffs = [f1[chosen][s] - f1[best][s] for s in sorted(f1[best])]
        seconds = {b: float(r["seconds_to_target_mean"]) for b, r in table.items()}
        assert f"{seconds[best] / seconds[chosen]:.1f}x faster to the target than batch {best}" in first
        if seeds >= 2:
            half = stats.t.ppf(0.975, len(diffs) - 1) * stats.sem(diffs)
            assert f"at a test F1 {statistics.fmean(diffs):+.4f} ± {half:.4f} against it" in first
        else:
            assert f"at a test F1 {diffs[0]:+.4f} (one seed: no interval) against it" in first
