"""`make docker-check` (scripts/docker-check.sh): the Dockerfile built by a real engine and the pipeline
run in the image, as its non-root user, to a clean `dvc status`; a broken Dockerfile fails with the
engine's own line. Opt-in (BATCHLAB_DOCKER_CHECK=1): a first build and run take about 15 minutes on
2 cores, too long for every CI run; without an engine the check skips with one line."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support import REPO

pytestmark = pytest.mark.e2e
OPT_IN = pytest.mark.skipif(
    os.environ.get("BATCHLAB_DOCKER_CHECK") != "1",
    reason="BATCHLAB_DOCKER_CHECK=1 builds the image and runs the pipeline in it (~15 min the first time)",
)

SCRIPT = REPO / "scripts" / "docker-check.sh"


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=3600)
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("docker-check: skipped:")]
    if skipped and proc.returncode == 0:
        pytest.skip(skipped[0])
    return proc


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One real build and run for the module; the broken Dockerfiles below reuse its cached layers."""
    report = tmp_path_factory.mktemp("docker") / "report.json"
    proc = _check("--report", str(report))
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    figures: dict[str, object] = json.loads(report.read_text())
    figures["output"] = proc.stdout
    print(proc.stdout.splitlines()[-1])  # the PASS line with the figures, shown under `pytest -s`
    return figures


@OPT_IN
@pytest.mark.timeout(3600)
def test_the_image_runs_the_pipeline_as_its_user_to_a_clean_dvc_status(built: dict[str, object]) -> None:
    output = str(built["output"])
    assert "user: batchlab (1000)" in output
    assert "made: reports/metrics.json" in output and "made: models/model.onnx" in output
    assert "dvc status: Data and pipelines are up to date." in output
    assert "docker-check: PASS:" in output
    assert int(str(built["image_bytes"])) > 0 and float(str(built["run_seconds"])) > 0


@OPT_IN
@pytest.mark.timeout(3600)
@pytest.mark.parametrize(
    ("change", "engine_says"),
    [
        (("WORKDIR /app\n", "WORKDIR /app\nCOPY no-such-file /app/\n"), "no-such-file"),
        (('CMD ["make", "run", "VENV=/opt/venv"]', 'CMD ["mak", "run"]'), "executable file not found"),
    ],
    ids=["missing-file-in-copy", "wrong-cmd"],
)
def test_a_broken_dockerfile_fails_the_check_with_the_engines_line(
    built: dict[str, object], tmp_path: Path, change: tuple[str, str], engine_says: str
) -> None:
    text = (REPO / "Dockerfile").read_text()
    assert change[0] in text
    broken = tmp_path / "Dockerfile"  # outside the build context: the context and its cache stay as they are
    broken.write_text(text.replace(change[0], change[1]))
    proc = _check("--file", str(broken), "--tag", "batchlab:broken")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    failed = [line for line in proc.stderr.splitlines() if line.startswith("docker-check: FAIL:")]
    assert failed and engine_says in failed[0], proc.stderr[-3000:]


def test_bad_arguments_get_one_line() -> None:
    """Checked before any engine is looked for: cheap, so it runs in every CI run."""
    for args in (["--bogus"], ["--file", "/no/such/Dockerfile"], ["--tag", "Not A Tag"]):
        proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, (args, proc.stderr)
