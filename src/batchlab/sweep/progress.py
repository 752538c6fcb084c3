"""The sweep's progress: experiments done out of all, and the time left at the pace so far. A bar
on a terminal; one log line per finished group otherwise (a CI log, `dvc repro`'s captured output).

The executors report what finishes (`finished`); `run.run_sweep` opens the count around them, so a
runner given by a caller (the sweep flow's lanes) is counted too.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from typing import Any

log = logging.getLogger(__name__)


class Progress:
    def __init__(self, total: int, done: int, terminal: bool | None = None) -> None:
        self.total, self.done, self.started_with = total, done, done
        self.started = time.monotonic()
        self.bar: Any = None
        if (sys.stderr.isatty() if terminal is None else terminal) and done < total:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, desc="sweep", unit="experiment")

    def left_s(self) -> float | None:
        """Seconds left at the mean pace of the experiments this run finished (None before the first)."""
        ran = self.done - self.started_with
        return (time.monotonic() - self.started) / ran * (self.total - self.done) if ran else None

    def line(self) -> str:
        left = self.left_s()
        eta = "" if left is None or self.done == self.total else f", about {_duration(left)} left"
        return f"sweep: {self.done}/{self.total} experiments done{eta}"

    def advance(self, names: Iterable[str]) -> None:
        count = len(list(names))
        self.done = min(self.total, self.done + count)
        if self.bar is not None:
            self.bar.update(count)
        else:
            log.info("%s", self.line())

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


_CURRENT: ContextVar[Progress | None] = ContextVar("sweep_progress", default=None)


@contextlib.contextmanager
def counting(total: int, done: int) -> Iterator[Progress]:
    """Count the sweep's experiments while the context lasts: `done` of `total` finished before."""
    progress = Progress(total, done)
    token = _CURRENT.set(progress)
    try:
        yield progress
    finally:
        _CURRENT.reset(token)
        progress.close()


def finished(names: Iterable[str]) -> None:
    """Experiments that just finished (a group's seeds at once); nothing when no sweep is counting."""
    progress = _CURRENT.get()
    if progress is not None:
        progress.advance(names)
