"""`dvc plots show` writes a page that draws every chart with no network: vega, vega-lite and
vega-embed are inline (.dvc/plots_page.html, DVC's plots.html_template), where DVC's own page
loads them from a CDN and is blank offline. A headless Chromium that can reach nothing draws it."""

from __future__ import annotations

import csv
import itertools
import os
import re
import shutil
import subprocess
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.support import run

pytestmark = pytest.mark.e2e

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")

STUDY = "Sweep: val loss vs examples seen, every evaluation of every experiment, by batch size"
CHARTS = [  # every Vega chart's title, once each, in page order: the study first, then the training
    STUDY,
    "Loss curves",
    "Validation accuracy",
    "Confusion matrix (test)",
]
IMAGES = [  # the study's PNGs, moved by the page's script to follow its chart, in reading order
    "f1_vs_batch", "val_loss_curves", "steps_vs_examples", "throughput_vs_batch", "memory_vs_batch",
    "noise_scale_curves",
]  # fmt: skip


class _References(HTMLParser):
    """Every src/href of the page's tags (an inline script's text is not parsed as tags)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[str, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.refs += [(tag, value) for key, value in attrs if key in ("src", "href") and value]


def _browser() -> str:
    found = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    if found is None:
        why = "no headless Chromium: apt-get install chromium-headless-shell (.ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(why)  # CI must draw the page, not skip it
        pytest.skip(why)
    return found


def _drawn(browser: str, page: Path, profile: Path) -> str:
    """The page's DOM once its scripts ran, in a browser whose every network request fails."""
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={profile}",
           "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND",
           "--virtual-time-budget=30000", "--dump-dom", page.as_uri()]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _charts(dom: str) -> dict[str, list[str]]:
    """Each drawn chart's title -> the aria-labels of the marks vega drew in it (one per line, point, cell)."""
    starts = [m.start() for m in re.finditer(r'<div id="[^"]+" class="vega-embed', dom)] + [len(dom)]
    charts: dict[str, list[str]] = {}
    for start, end in itertools.pairwise(starts):
        chart = dom[start:end]
        # a facet's header is a title too; the chart's own title is drawn last
        titles = re.findall(r'"mark-group role-title".*?<text[^>]*>([^<]*)</text>', chart, re.S)
        assert '<svg xmlns="http://www.w3.org/2000/svg"' in chart and titles, chart[:500]
        assert titles[-1] not in charts, f"{titles[-1]!r} is drawn twice"
        charts[titles[-1]] = re.findall(r'<path aria-label="([^"]+)" role="graphics-symbol"[^>]* d="M', chart)
    return charts


def test_plots_page_loads_no_network_script_and_draws_every_chart_once(repo_copy: Path, tmp_path: Path) -> None:
    browser = _browser()
    run(["dvc", "plots", "show", "-o", "plots_html"], repo_copy)  # the plotted files are in Git: no repro needed
    page = repo_copy / "plots_html" / "index.html"
    html = page.read_text()

    parser = _References()
    parser.feed(html)
    assert [ref for tag, ref in parser.refs if tag == "script"] == []  # every library inline
    remote = [ref for _, ref in parser.refs if urlsplit(ref).scheme or ref.startswith("//")]
    assert remote == [], remote
    images = [ref for tag, ref in parser.refs if tag == "img"]
    assert len(images) == len(set(images)) == 6 and all((page.parent / ref).is_file() for ref in images), images
    assert not any("confusion" in ref for ref in images)  # the matrix is drawn once, from predictions.csv

    dom = _drawn(browser, page, tmp_path / "profile")
    assert "<h1>batchlab: the batch-size study, then the training</h1>" in dom
    charts = _charts(dom)
    assert list(charts) == CHARTS, list(charts)
    # the page reads: the study's chart, its images in order, then the training's charts
    at = [dom.index(f'id="reports_sweep_{name}_png"') for name in IMAGES]
    assert at == sorted(at) and dom.index(STUDY) < at[0] < dom.index('"mark-group role-title"', at[-1]), at
    assert all(charts.values()), {title: len(marks) for title, marks in charts.items()}  # every chart has marks
    lines = {label.split("field: ")[-1] for label in charts["Loss curves"]}
    assert {"train_loss", "val_loss"} <= lines, lines

    with open(repo_copy / "reports/predictions.csv") as rows:
        truth = Counter((row["actual"], row["predicted"]) for row in csv.DictReader(rows))
    cells = {
        (m[1], m[2]): int(m[3])
        for label in charts["Confusion matrix (test)"]
        if (m := re.fullmatch(r"actual: (\d+); predicted: (\d+); xy_count: (\d+)", label))
    }
    assert cells == dict(truth)  # the cells the browser drew hold predictions.csv's counts

    with open(repo_copy / "reports/sweep/curves.csv") as rows:
        sizes = Counter(row["batch_size"] for row in csv.DictReader(rows))
    drawn = Counter(re.search(r"batch size: (\d+)", label)[1] for label in charts[STUDY])  # type: ignore[index]
    assert drawn == sizes  # every evaluation of every experiment, one point each, coloured by its batch size
