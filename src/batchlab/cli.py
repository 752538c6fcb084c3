"""`batchlab <command>`: parses the arguments, runs one command (commands.py), prints its error in
one line with its exit status.

Nothing but argparse is imported before the arguments are parsed, so `--help` and a usage
error answer at once; each command then imports what it needs (validate: no torch, no mlflow;
generate: scikit-learn, no torch, no mlflow).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import NoReturn

from batchlab.commands import COMMANDS

BAD_INPUT = 2
# commands whose process may loop for hours outside a training loop, so it keeps collecting garbage
# throughout (batchlab.collector): the sweep's scheduler, predict's pass over an input of any size
LONG_LIVED = {"sweep", "predict"}


def _options(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """--params and --out, before or after the command. After it, they default to SUPPRESS: a
    subcommand's defaults would otherwise overwrite what was given before the command."""
    parser.add_argument(
        "--params",
        type=Path,
        default=Path("params.yaml") if defaults else argparse.SUPPRESS,
        help="params file (default params.yaml)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None if defaults else argparse.SUPPRESS,
        help="write models/ and reports/ under this folder instead of the current one",
    )


class _Parser(argparse.ArgumentParser):
    """A usage error is one line, as every other error (argparse prints the usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(BAD_INPUT, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def _terminate(signum: int, frame: FrameType | None) -> None:
    from batchlab.tracking import Interrupted

    raise Interrupted(f"signal {signum}")


def _configure_logging() -> None:
    """One line per stage on stderr. mlflow sets its own logger's level and handler when it is
    imported (after this runs), so its level is given through its own variable, which its
    children inherit too."""
    level = os.environ.get("BATCHLAB_LOG", "INFO")
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr)
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    for noisy in ("mlflow", "alembic", "urllib3", "git", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="batchlab",
        description="batchlab pipeline stages: `dvc repro` runs them in order; `batchlab <command> --help` "
        "says what each one reads and writes.",
    )
    _options(parser, defaults=True)
    sub = parser.add_subparsers(dest="stage", required=True, metavar="<command>")
    for name, command in COMMANDS.items():
        summary = command.summary
        subparser = sub.add_parser(
            name, help=summary, description=f"{summary[0].upper()}{summary[1:]}. {command.files}"
        )
        _options(subparser, defaults=False)
        for flags, options in command.arguments:
            subparser.add_argument(*flags, **options)
    return parser


def _status(args: argparse.Namespace) -> int:
    # the error types: none of these modules imports torch or mlflow
    from batchlab import tracking
    from batchlab.config import ConfigError
    from batchlab.data import DataError
    from batchlab.training import launch

    signal.signal(signal.SIGTERM, _terminate)
    try:
        COMMANDS[args.stage].run(args)
    except (ConfigError, DataError) as err:
        print(f"batchlab: error: {err}", file=sys.stderr)
        return BAD_INPUT
    except (tracking.TrackingUnavailable, launch.LaunchError, RuntimeError, FileNotFoundError) as err:
        print(f"batchlab: error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # the machine's own: no space left, a read-only folder, a file where a folder goes
        print(f"batchlab: error: {os_error(err)}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, tracking.Interrupted):
        print("batchlab: interrupted", file=sys.stderr)
        return 130
    return 0


def os_error(err: OSError) -> str:
    """An OS error as one line: what failed, where, and what to do; every output is written to a
    temporary name and renamed (atomic.py), so nothing is left half-written, and a training rerun
    resumes from its last checkpoint."""
    code = errno.errorcode.get(err.errno or 0, "")
    where = f" at {err.filename}" if err.filename else ""
    what = err.strerror or str(err)
    fix = _FIXES.get(err.errno or 0, "fix the folder")
    return f"{what}{where} ({code}); {fix}, then rerun (a training resumes from its last checkpoint)"


_WRITE_ELSEWHERE = "or write elsewhere (--out; tracking.tracking_uri for the MLflow store)"
_FIXES = {
    errno.ENOSPC: "free some space on that disk",
    errno.EDQUOT: "free some of your disk quota",
    errno.EROFS: f"mount it writable {_WRITE_ELSEWHERE}",
    errno.EACCES: f"make it writable for this user {_WRITE_ELSEWHERE}",
    errno.EPERM: f"make it writable for this user {_WRITE_ELSEWHERE}",
    errno.ENOTDIR: f"a file stands where a folder goes: move it {_WRITE_ELSEWHERE}",
    errno.EEXIST: f"something stands where a folder goes: move it {_WRITE_ELSEWHERE}",
    errno.EISDIR: f"a folder stands where a file goes: move it {_WRITE_ELSEWHERE}",
}


def main(argv: list[str] | None = None) -> int:
    """Run the command in `argv` and return its exit status. Without `argv` this is the program
    (the `batchlab` script, `python -m batchlab.cli`): it reads sys.argv and ends the process."""
    # --help and usage errors exit here, before anything heavier than argparse is imported
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if argv is None and args.stage not in LONG_LIVED:
        from batchlab import collector

        collector.pause()  # this process's own: its libraries load without full collections
    _configure_logging()
    status = _status(args)
    if argv is None:
        from batchlab import collector

        collector.exit_now(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
