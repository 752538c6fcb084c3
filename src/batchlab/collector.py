"""Python's cyclic garbage collector, paused while a command loads its libraries.

Loading torch, mlflow with its SQL store, scikit-learn and torch._dynamo leaves millions of objects
that live as long as the process, and each of CPython's full collections scans them all again. In
the four pipeline stages that came to 3.6 s of 22 s here (timed with gc.callbacks: 0.2 s in
generate, 1.6 s in train, 0.9 s each in evaluate and export), nearly all of it while importing.

`batchlab <command>` pauses the collector before anything heavy is imported (`pause`). A loop that
may run for hours (training) first calls `resume`: whatever is alive then moves to the permanent
generation (gc.freeze) and collection starts again, so it scans only what the loop itself creates.
A command with no such loop (generate, evaluate, export) ends with the collector still paused: its
cyclic garbage is the little its imports and one pass over its data leave, freed by the OS at exit.

Only a process that `pause` paused is ever resumed: fit() in a notebook, a test or a Prefect task
leaves that process's collector as it found it. At its end the program skips the teardown of its
modules as well (`exit_now`): freeing what the OS frees at once took 0.5-1.5 s.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
from typing import NoReturn

_paused = False


def pause() -> None:
    """Stop cyclic collection until `resume` (reference counting still frees everything else)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """Collect again, leaving out what is alive now (the loaded libraries); a no-op unless `pause` paused it."""
    global _paused
    if _paused:
        gc.freeze()
        gc.enable()
        _paused = False


def exit_now(status: int) -> NoReturn:
    """End the process as the interpreter would, minus the teardown of its modules: 0.5-1.5 s with
    torch, mlflow and scikit-learn loaded, freeing memory the OS frees at once. What comes before it
    runs as usual, in the same order (Py_FinalizeEx): threads are joined, atexit handlers run
    (logging, mlflow), stdout and stderr are flushed. Every output is written and closed by now."""
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own first step at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)
