"""The Makefile's own targets: help and compare."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, run

STAMP = ".batchlab-installed"  # the Makefile's $(STAMP) inside $(VENV)


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    """VENV= for make: this environment, linked entry by entry, with a fresh set-up stamp, so that
    `setup` has nothing to do (it would otherwise pip-install into the shared environment)."""
    folder = tmp_path / "venv"
    folder.mkdir()
    for entry in Path(sys.prefix).iterdir():
        if entry.name != STAMP:
            (folder / entry.name).symlink_to(entry)
    (folder / STAMP).touch()
    return folder


def _make(venv: Path, *args: str) -> list[str]:
    return ["make", "--no-print-directory", "-f", str(REPO / "Makefile"), f"VENV={venv}", *args]


def test_make_help_is_the_default_and_lists_every_target_with_its_comment(venv: Path) -> None:
    shown = run(_make(venv), REPO).stdout
    phony = re.search(r"^\.PHONY:(.*)$", (REPO / "Makefile").read_text(), flags=re.M)
    assert phony is not None
    for target in phony.group(1).split():
        assert re.search(rf"^  make {target} +\S", shown, flags=re.M), f"`make help` misses {target}:\n{shown}"


def test_make_compare_fits_a_terminal_and_shows_changed_params_and_headline_metrics(
    repo_copy: Path, venv: Path
) -> None:
    """The committed dvc.lock and metrics (HEAD) against a workspace with another learning rate."""
    params = yaml.safe_load((repo_copy / "params.yaml").read_text())
    params["train"]["lr"] = 0.5
    (repo_copy / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shown = run(_make(venv, "compare"), repo_copy, COLUMNS="100").stdout
    for wanted in ("workspace", "train.lr", "0.5", "accuracy", "f1_macro", "roc_auc"):
        assert wanted in shown, f"{wanted!r} missing:\n{shown}"
    # unchanged params, per-class metrics and the deps' hash columns are left out: nothing is cut
    for unwanted in ("…", "train.epochs", "precision_0", "f1_weighted", "src/batchlab", "data/prepared"):
        assert unwanted not in shown, f"{unwanted!r} shown:\n{shown}"
