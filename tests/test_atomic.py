"""Outputs are written under a temporary name and renamed: a failure never leaves half a file."""

from __future__ import annotations

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
