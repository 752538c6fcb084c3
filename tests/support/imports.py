"""A program that runs `batchlab` and reports which modules it imported: the CLI's light paths
import neither torch nor MLflow."""

from __future__ import annotations

# a fresh interpreter, so that sys.modules shows what the CLI itself imported
IMPORTS = """
import sys
from batchlab.cli import main
try:
    status = main(sys.argv[2:])
except SystemExit as exit_:
    status = exit_.code
print("imported:", ",".join(m for m in sys.argv[1].split(",") if m in sys.modules))
sys.exit(status)
"""
