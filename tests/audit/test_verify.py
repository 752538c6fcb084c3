"""`batchlab verify`: one flipped byte in a DVC cache file, a workspace output or a stored MLflow model
is named, and an intact repo passes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from batchlab.audit.verify import dir_hash, md5
from tests.support import TINY, run, set_params, write_params


def _flip(path: Path, offset: int = 0) -> None:
    """Change one byte, as a disk error would (DVC's cache files are read-only)."""
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _verify(repo: Path, *args: str) -> tuple[int, list[str], str]:
    proc = run(["batchlab", *args, "verify"], repo, check=False)
    return proc.returncode, proc.stdout.splitlines(), proc.stderr.strip()


def _cache_file(repo: Path, md5: str) -> Path:
    return repo / ".dvc/cache/files/md5" / md5[:2] / md5[2:]


@pytest.mark.integration
def test_dvc_add_then_a_flipped_cache_byte_is_named_and_intact_passes(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    write_params(repo, TINY)
    (repo / "data/table.bin").write_bytes(bytes(range(256)) * 4)
    (repo / "data/set").mkdir()
    for i in range(3):
        (repo / f"data/set/part{i}.bin").write_bytes(bytes([i]) * 100)
    # as strings "a-b.bin" sorts before "a/y.bin", as path parts after: DVC's order decides the hash
    (repo / "data/set/a").mkdir()
    (repo / "data/set/a/y.bin").write_bytes(b"y")
    (repo / "data/set/a-b.bin").write_bytes(b"ab")
    run(["git", "init", "-q"], repo)
    run(["dvc", "init", "-q"], repo)
    run(["dvc", "add", "-q", "data/table.bin", "data/set"], repo)

    status, lines, err = _verify(repo)
    assert status == 0, (lines, err)
    # 6 files, each here and in the cache, and the cached listing of data/set
    assert lines[0] == "verify: 13 files of 2 DVC outputs re-hashed; all match"
    recorded = yaml.safe_load((repo / "data/set.dvc").read_text())["outs"][0]["md5"]
    files = [p for p in (repo / "data/set").rglob("*") if p.is_file()]
    assert dir_hash({p.relative_to(repo / "data/set").as_posix(): md5(p) for p in files}) == recorded

    table = yaml.safe_load((repo / "data/table.bin.dvc").read_text())["outs"][0]["md5"]
    _flip(_cache_file(repo, table), offset=100)
    status, lines, err = _verify(repo)
    assert status == 1 and err == "batchlab: error: 1 files differ from their recorded hashes (above)"
    [mismatch] = [line for line in lines if line.startswith("mismatch:")]
    assert re.fullmatch(
        rf"mismatch: data/table.bin: cache entry \.dvc/cache/files/md5/{table[:2]}/{table[2:]} "
        rf"holds md5 [0-9a-f]{{32}}, not {table}",
        mismatch,
    ), mismatch
    _flip(_cache_file(repo, table), offset=100)  # back as it was

    listing = json.loads(
        _cache_file(repo, yaml.safe_load((repo / "data/set.dvc").read_text())["outs"][0]["md5"]).read_text()
    )
    part1 = next(e["md5"] for e in listing if e["relpath"] == "part1.bin")
    _flip(_cache_file(repo, part1))
    _flip(repo / "data/set/part2.bin")
    status, lines, _ = _verify(repo)
    mismatches = sorted(line.split(":")[1].strip() for line in lines if line.startswith("mismatch:"))
    assert status == 1 and mismatches == ["data/set/part1.bin", "data/set/part2.bin"], lines


@pytest.mark.integration
def test_pipeline_outputs_cache_and_mlflow_models_are_checked(repo_copy: Path) -> None:
    set_params(repo_copy, "tracking", enabled=True)
    (repo_copy / "dvc.lock").unlink()  # this run's stages only (the committed lock also records a sweep)
    run(["dvc", "repro", "evaluate", "export"], repo_copy)
    status, lines, err = _verify(repo_copy)
    assert status == 0, (lines, err)
    assert re.fullmatch(r"verify: \d+ files of 12 DVC outputs, 3 MLflow models re-hashed; all match", lines[0]), lines

    # MLflow writes registered_model_meta into the model's folder when a registered version is loaded:
    # not batchlab's file, not a mismatch
    store = f"sqlite:///{repo_copy / 'mlflow.db'}"
    subprocess.run([sys.executable, "-c", "import mlflow, sys; mlflow.set_tracking_uri(sys.argv[1]); "
                    "mlflow.pyfunc.load_model('models:/batchlab-mlp@champion')", store],
                   cwd=repo_copy, check=True, capture_output=True)  # fmt: skip
    assert list((repo_copy / "mlruns").glob("*/models/*/artifacts/registered_model_meta"))
    status, lines, err = _verify(repo_copy)
    assert status == 0 and lines[0].endswith("all match"), (lines, err)

    # an output deleted from the workspace, its cache entry intact: a mismatch, not a note
    onnx_bytes = (repo_copy / "models/model.onnx").read_bytes()
    (repo_copy / "models/model.onnx").unlink()
    status, lines, _ = _verify(repo_copy)
    deleted = "mismatch: models/model.onnx is missing from the workspace (`dvc checkout models/model.onnx` restores it)"
    assert status == 1 and deleted in lines, lines
    (repo_copy / "models/model.onnx").write_bytes(onnx_bytes)

    lock = yaml.safe_load((repo_copy / "dvc.lock").read_text())["stages"]
    weights = next(o["md5"] for o in lock["train"]["outs"] if o["path"] == "models/model.pt")
    _flip(_cache_file(repo_copy, weights), offset=200)
    _flip(repo_copy / "models/model.onnx", offset=50)
    run_id = json.loads((repo_copy / "reports/train.json").read_text())["run_id"]
    stored = next((repo_copy / "mlruns").glob("*/models/*/artifacts/model.onnx"))
    _flip(stored, offset=60)
    status, lines, _ = _verify(repo_copy)
    mismatches = [line for line in lines if line.startswith("mismatch:")]
    assert status == 1 and len(mismatches) == 3, lines
    assert mismatches[0].startswith("mismatch: models/model.pt: cache entry .dvc/cache/files/md5/"), mismatches
    assert mismatches[1].startswith("mismatch: models/model.onnx: md5 "), mismatches
    assert f"of run {run_id}: model.onnx has sha256" in mismatches[2], mismatches
