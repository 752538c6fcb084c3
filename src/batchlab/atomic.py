"""Write outputs under a temporary name and rename, so a crash never leaves half a file; CSV tables
of rows (dicts) written that way and read back.

A temporary's name carries its writer's pid and host (`.metrics.json.4242.myhost.k3j_9a2b.tmp`): a
writer killed with SIGKILL cannot remove its own, so the next write of the same path removes those
whose process is gone, and never one of a process still running."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# the host in a temporary's name: a pid means nothing on another machine sharing the folder
_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process, or no pid at all: not ours to judge
        return True
    return True


def remove_stale_temporaries(path: str | Path) -> list[Path]:
    """Remove the temporaries of `path` left beside it by writers on this host that no longer run
    (killed before they could clean up); return them. A pid reused since errs on the side of keeping."""
    path = Path(path)
    # exactly the names atomic_path makes: its prefix, then mkstemp's 8 random characters
    name = re.compile(re.escape(f".{path.name}.") + r"([0-9]{1,10})\." + re.escape(_HOST) + r"\.[a-z0-9_]{8}\.tmp")
    with os.scandir(path.parent) as entries:
        stale = [Path(e.path) for e in entries if (m := name.fullmatch(e.name)) and not _alive(int(m[1]))]
    for tmp in stale:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    return stale


@contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """An OSError raised inside that names no file (a write that failed: no space left) is raised
    again naming `path`, so the user's one line says where."""
    try:
        yield
    except OSError as err:
        if err.filename is None and err.errno is not None:
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it replaces `path` (file or folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    prefix = f".{path.name}.{os.getpid()}.{_HOST}."
    fd, tmp_name = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    tmp.unlink()
    try:
        with naming(path):  # a failed write (no space left) names the file it was writing
            yield tmp
            if tmp.is_dir() and path.exists():
                old = path.with_name(f".{path.name}.old")
                shutil.rmtree(old, ignore_errors=True)
                path.rename(old)
                tmp.rename(path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def write_with(path: str | Path, writer: Callable[[Path], Any]) -> None:
    with atomic_path(path) as tmp:
        writer(tmp)


def write_text(path: str | Path, text: str) -> None:
    write_with(path, lambda tmp: tmp.write_text(text))


def write_json(path: str | Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def to_csv(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """Rows as CSV text; `columns` names the header when there may be no rows."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns or list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def write_csv(path: str | Path, rows: list[dict[str, Any]], columns: list[str] | None = None) -> None:
    write_text(path, to_csv(rows, columns))


def read_csv(path: str | Path) -> list[dict[str, str]]:
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))
