"""Outputs are written under a temporary name and renamed: a failure never leaves half a file."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from batchlab import atomic


def test_a_failed_write_leaves_the_old_file_and_no_temporary_files(tmp_path: Path) -> None:
    target = tmp_path / "reports" / "metrics.json"
    atomic.write_json(target, {"f1": 0.9})
    before = target.read_bytes()

    def half_then_crash(tmp: Path) -> None:
        tmp.write_text('{"f1": 0.')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic.write_with(target, half_then_crash)
    assert target.read_bytes() == before
    assert sorted(p.name for p in target.parent.iterdir()) == ["metrics.json"]


def test_a_folder_is_replaced_whole(tmp_path: Path) -> None:
    target = tmp_path / "prepared"
    for content in ("old", "new"):
        with atomic.atomic_path(target) as tmp:
            tmp.mkdir()
            (tmp / f"{content}.npy").write_text(content)
    assert [p.name for p in target.iterdir()] == ["new.npy"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared"]


def test_json_is_sorted_and_ends_with_a_newline(tmp_path: Path) -> None:
    atomic.write_json(tmp_path / "a.json", {"b": 1, "a": 2})
    assert (tmp_path / "a.json").read_text() == '{\n  "a": 2,\n  "b": 1\n}\n'


# a writer of `argv[1]` (a folder when argv[2] says so) that prints its temporary, then is killed
# (argv[3] == "kill") or holds it until stdin closes
WRITER = """
import os, signal, sys
from batchlab import atomic
with atomic.atomic_path(sys.argv[1]) as tmp:
    tmp.mkdir() if sys.argv[2] == "folder" else tmp.write_text("half")
    print(tmp, flush=True)
    if sys.argv[3] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdin.read()
"""


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_sigkilled_writers_temporary_goes_at_the_next_write_and_a_running_ones_stays(
    tmp_path: Path, kind: str
) -> None:
    target = tmp_path / "prepared"

    def writer(how: str) -> tuple[subprocess.Popen[str], Path]:
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(target), kind, how],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert proc.stdout is not None
        return proc, Path(proc.stdout.readline().strip())

    killed, left = writer("kill")
    assert killed.wait(timeout=60) == -signal.SIGKILL and left.exists()
    running, held = writer("hold")
    try:
        with atomic.atomic_path(target) as tmp:
            tmp.mkdir() if kind == "folder" else tmp.write_text("whole")
        assert not left.exists() and held.exists()  # the dead process's went, the live one's stays
    finally:
        running.communicate("", timeout=60)  # stdin closed: it finishes its write
    assert running.returncode == 0
    assert [p.name for p in tmp_path.iterdir()] == ["prepared"]
