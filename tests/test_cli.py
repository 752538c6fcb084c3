"""`batchlab`: options in either position, help that says what each stage reads and writes,
no heavy import before the arguments are parsed, one line per stage (no MLflow chatter), and no
garbage collection while the program loads its libraries."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from batchlab import collector
from batchlab.cli import _parser, main
from tests.support import REPO, TINY, env_with_venv, merge, run, write_params
from tests.support.imports import IMPORTS


def _stages() -> dict[str, dict[str, list[object]]]:
    return dict(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])


@pytest.mark.parametrize(
    "argv",
    [
        ["--params", "tiny.yaml", "--out", "exp1", "train"],
        ["train", "--params", "tiny.yaml", "--out", "exp1"],
        ["--params", "tiny.yaml", "train", "--out", "exp1"],
    ],
)
def test_params_and_out_work_before_and_after_the_command(argv: list[str]) -> None:
    args = _parser().parse_args(argv)
    assert (args.stage, args.params, args.out) == ("train", Path("tiny.yaml"), Path("exp1"))


def test_defaults_hold_when_no_option_is_given() -> None:
    args = _parser().parse_args(["evaluate"])
    assert (args.params, args.out) == (Path("params.yaml"), None)


def _path(entry: object) -> str:
    return next(iter(entry)) if isinstance(entry, dict) else str(entry)


@pytest.mark.parametrize("stage", list(_stages()))
def test_each_stage_help_lists_the_options_and_what_dvc_yaml_says_it_reads_and_writes(
    stage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args([stage, "--help"])
    assert exit_.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--params" in shown and "--out" in shown
    spec = _stages()[stage]
    files = [_path(e) for key in ("outs", "metrics") for e in spec.get(key, [])]
    # data deps (not code, not validate's stamp, which every stage has)
    files += [d for d in map(_path, spec["deps"]) if not d.startswith(("src/", ".batchlab/params.ok"))]
    missing = [f for f in files if f not in shown]
    assert not missing, f"`batchlab {stage} --help` does not mention {missing}:\n{shown}"


@pytest.mark.parametrize(
    ("argv", "status", "unwanted"),
    [
        # answered by argparse alone: not even numpy or pydantic
        (["--help"], 0, "torch,mlflow,numpy,pydantic,yaml"),
        (["train", "--help"], 0, "torch,mlflow,numpy,pydantic,yaml"),
        (["train", "--bogus"], 2, "torch,mlflow,numpy,pydantic,yaml"),
        # runs on every params change, tracking enabled or not
        (["validate"], 0, "torch,mlflow,sklearn,pandas"),
        # scikit-learn makes the data; nothing trains or tracks
        (["generate"], 0, "torch,mlflow"),
    ],
)
@pytest.mark.integration
def test_help_usage_errors_and_validate_skip_the_heavy_imports(
    argv: list[str], status: int, unwanted: str, tmp_path: Path
) -> None:
    tracked = {"tracking": {"enabled": True, "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}}
    write_params(tmp_path, merge(TINY, tracked))
    proc = subprocess.run(
        [sys.executable, "-c", IMPORTS, unwanted, *argv],
        cwd=tmp_path,
        env=env_with_venv(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == status, proc.stderr
    assert proc.stdout.splitlines()[-1] == "imported: ", proc.stdout
    if argv == ["validate"]:
        assert (tmp_path / ".batchlab/params.ok").is_file() and not (tmp_path / "mlflow.db").exists()
    if argv == ["generate"]:
        assert (tmp_path / "data/prepared/dataset.json").is_file() and not (tmp_path / "mlflow.db").exists()


MLFLOW_CHATTER = (
    "INFO mlflow",
    "Creating initial MLflow database tables",
    "Updating database tables",
    "Experiment with name",
    "Successfully registered model",
    "Created version",
)


@pytest.mark.integration
def test_tracked_stages_print_their_own_lines_and_no_mlflow_info(tmp_path: Path) -> None:
    tracked = {"tracking": {"enabled": True, "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}}
    write_params(tmp_path, merge(TINY, tracked))
    stderr = {stage: run(["batchlab", stage], tmp_path).stderr for stage in ("generate", "train", "evaluate", "export")}
    # the stages did create the store, log to MLflow and register a model: the silence below means something
    assert "epoch 4/4" in stderr["train"] and "new 'champion'" in stderr["export"], stderr
    chatter = [
        f"{stage}: {line}"
        for stage, err in stderr.items()
        for line in err.splitlines()
        if any(noise in line for noise in MLFLOW_CHATTER)
    ]
    assert not chatter, chatter


@pytest.mark.integration
def test_ui_url_is_the_plain_address_until_the_store_exists_and_creates_nothing(tmp_path: Path) -> None:
    write_params(tmp_path, TINY)
    store = tmp_path / "mlflow.db"
    shown = run(["batchlab", "ui-url", "--store", f"sqlite:///{store}", "--port", "5123"], tmp_path).stdout
    assert shown.strip() == "http://127.0.0.1:5123" and not store.exists()


@pytest.mark.integration
def test_the_program_ends_with_the_commands_status_and_its_output_written(tmp_path: Path) -> None:
    write_params(tmp_path, TINY)
    shown = run(["batchlab", "ui-url", "--port", "5123"], tmp_path)  # stdout is a pipe: block-buffered
    assert (shown.returncode, shown.stdout) == (0, "http://127.0.0.1:5123\n")
    failed = run(["batchlab", "train"], tmp_path, check=False)  # nothing generated yet
    assert failed.returncode == 2 and "no prepared dataset" in failed.stderr


@pytest.mark.integration
def test_train_picks_its_threads_when_train_threads_is_0(tmp_path: Path) -> None:
    write_params(tmp_path, merge(TINY, {"train": {"threads": 0, "epochs": 1}}))
    run(["batchlab", "generate"], tmp_path)
    stderr = run(["batchlab", "train"], tmp_path, BATCHLAB_LOG="DEBUG").stderr
    assert "torch threads: 1" in stderr, stderr  # a 16-wide model: one thread, whatever the machine


# the program as the `batchlab` script runs it, saying at exit what its garbage collector was doing
COLLECTOR = """
import atexit, gc, sys
atexit.register(lambda: print(f"collecting={gc.isenabled()} frozen={gc.get_freeze_count() > 0}"))
sys.argv = ["batchlab", *sys.argv[1:]]
from batchlab.cli import main
main()
"""


@pytest.mark.integration
def test_the_program_collects_no_garbage_while_loading_and_resumes_when_training_starts(tmp_path: Path) -> None:
    write_params(tmp_path, merge(TINY, {"train": {"epochs": 1}}))

    def collector_at_exit(command: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-c", COLLECTOR, command],
            cwd=tmp_path,
            env=env_with_venv(),
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.splitlines()[-1]

    # generate has no loop: paused to the end; train collects from its first epoch on, skipping what loaded before
    assert collector_at_exit("generate") == "collecting=False frozen=False"
    assert collector_at_exit("train") == "collecting=True frozen=True"
    assert (tmp_path / "models/model.pt").is_file()


def test_a_process_calling_main_or_fit_itself_keeps_its_collector_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path, TINY)
    frozen = gc.get_freeze_count()
    assert main(["validate"]) == 0
    collector.resume()  # what fit() calls before its first epoch
    assert gc.isenabled() and gc.get_freeze_count() == frozen


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["predict", "--model", "m.onnx", "--input", "x.csv", "--chunk-rows", "0"],
         "batchlab predict: error: argument --chunk-rows: must be a positive integer, got '0'"),
        (["nosuch"], "batchlab: error: argument <command>: invalid choice: 'nosuch'"),
        ([], "batchlab: error: the following arguments are required: <command>"),
    ],
)  # fmt: skip
@pytest.mark.integration
def test_a_usage_error_is_one_line_naming_the_argument_and_exit_2(argv: list[str], message: str) -> None:
    proc = subprocess.run(["batchlab", *argv], env=env_with_venv(), capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert line.startswith(message) and line.endswith("--help` lists the options)"), line


def _one_error_line(cmd: list[str], cwd: Path) -> str:
    """The one error line of a failing `batchlab` command: exit 1, no traceback (the epoch lines
    before it are training's own)."""
    from tests.support import run

    proc = run(["batchlab", *cmd], cwd, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("batchlab: error: ")]
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


@pytest.mark.integration
def test_the_machines_own_faults_are_one_line_and_a_rerun_after_them_resumes(workdir: Path) -> None:
    """A file where the output folder goes, and a full disk (a 1 MiB tmpfs, filled) under a training
    and a sweep: one line naming the path and the errno, exit 1, nothing half-written; freed, the
    rerun finishes."""
    from batchlab import stages
    from batchlab.paths import Paths
    from tests.support import run, tiny_config, write_params
    from tests.support.disks import fill, tmpfs

    cfg = tiny_config()
    write_params(workdir, cfg.model_dump(mode="json"))
    stages.generate(cfg, Paths(workdir))
    (workdir / "a-file").write_text("not a folder")

    line = _one_error_line(["train", "--out", "a-file/run"], workdir)
    assert line.startswith("batchlab: error: Not a directory at a-file/run") and "(ENOTDIR)" in line, line

    with tmpfs(workdir / "disk", "size=1m") as disk:
        filler = disk / "filler"
        fill(filler)
        line = _one_error_line(["train", "--out", str(disk / "run")], workdir)
        assert line.startswith(f"batchlab: error: No space left on device at {disk / 'run'}") and "(ENOSPC)" in line
        written = [p for p in (disk / "run").rglob("*") if p.is_file()] if (disk / "run").exists() else []
        assert all(p.stat().st_size > 0 and ".tmp" not in p.name for p in written), written  # nothing half-written
        filler.unlink()
        run(["batchlab", "train", "--out", str(disk / "run")], workdir)
        assert (disk / "run" / "models" / "model.pt").is_file()

        fill(filler)  # the sweep's folder on a full disk too, then freed
        line = _one_error_line(["sweep", "--out", str(disk / "study")], workdir)
        assert line.startswith(f"batchlab: error: No space left on device at {disk / 'study'}") and "(ENOSPC)" in line
        filler.unlink()
        run(["batchlab", "sweep", "--out", str(disk / "study")], workdir)
        assert (disk / "study" / "reports" / "sweep" / "summary.md").is_file()


@pytest.mark.integration
def test_a_read_only_folder_and_a_full_mlflow_store_are_one_line_and_the_rerun_after_them_resumes(
    workdir: Path,
) -> None:
    """A read-only filesystem under the outputs, the sweep's folder and the SQLite MLflow store, and
    that store's disk full (a 16 MiB tmpfs, filled: before the store exists and after): one line
    naming the path, the errno and what to do, exit 1, no traceback (MLflow's own logged one
    included); mounted writable or freed, the rerun finishes."""
    import subprocess

    from mlflow import MlflowClient

    from batchlab import stages
    from batchlab.paths import Paths
    from tests.support import run, tiny_config, write_params
    from tests.support.disks import fill, tmpfs

    cfg = tiny_config()
    write_params(workdir, cfg.model_dump(mode="json"))
    stages.generate(cfg, Paths(workdir))
    with tmpfs(workdir / "ro", "size=16m,ro") as ro, tmpfs(workdir / "store", "size=16m") as store:
        fix = "mount it writable or write elsewhere (--out; tracking.tracking_uri for the MLflow store), then rerun"
        for cmd in (["train", "--out", "ro/run"], ["sweep", "--out", "ro/study"]):
            line = _one_error_line(cmd, workdir)
            assert line.startswith(f"batchlab: error: Read-only file system at {cmd[-1]}") and "(EROFS)" in line
            assert fix in line, line
        tracked = cfg.model_dump(mode="json")
        tracked["tracking"] = {"enabled": True, "tracking_uri": "sqlite:///ro/mlflow.db", "registered_model": ""}
        write_params(workdir, tracked, "ro.yaml")
        line = _one_error_line(["--params", "ro.yaml", "train", "--out", "run-ro"], workdir)
        assert line.startswith(f"batchlab: error: Read-only file system at {ro / 'mlflow.db'}"), line
        subprocess.run(["mount", "-o", "remount,rw", str(ro)], check=True)
        run(["batchlab", "train", "--out", "ro/run"], workdir)
        run(["batchlab", "--params", "ro.yaml", "train", "--out", "run-ro"], workdir)

        tracked["tracking"]["tracking_uri"] = "sqlite:///store/mlflow.db"
        write_params(workdir, tracked, "store.yaml")
        filler = store / "filler"
        fill(filler)  # before the store exists: its tables cannot be made
        line = _one_error_line(["--params", "store.yaml", "train", "--out", "run-store"], workdir)
        assert line == ("batchlab: error: No space left on device at store/mlflow.db (ENOSPC); free some space on "
                        "that disk, then rerun (a training resumes from its last checkpoint)"), line  # fmt: skip
        filler.unlink()
        run(["batchlab", "--params", "store.yaml", "train", "--out", "run-store"], workdir)
        fill(filler)  # the store made, its disk full
        line = _one_error_line(["--params", "store.yaml", "train", "--out", "run-store-2"], workdir)
        assert line.startswith("batchlab: error: No space left on device at store/mlflow.db (ENOSPC)"), line
        filler.unlink()
        run(["batchlab", "--params", "store.yaml", "train", "--out", "run-store-2"], workdir)
        client = MlflowClient(f"sqlite:///{store / 'mlflow.db'}")
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED"]  # none left RUNNING
