"""The sweep's saved MLflow view: written as MLflow's UI saves one, read back by MLflow's own UI."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from batchlab.tracking import views


def test_a_view_reads_back_as_written_and_fits_mlflows_limit() -> None:
    metrics = [f"gns.figure_{i}" for i in range(150)] + ["val_loss", "summary.test_f1_macro"]
    state = views.state("abc123", "train.batch_size", "sweep.batch_size", metrics)
    value = views.encode("dvc-sweep-single-fp32-bs16-512-3f9a2c", state, now_ms=1_700_000_000_000)
    assert len(value) <= views.MAX_VALUE
    wrapper = json.loads(value)
    assert wrapper["state"].startswith("deflate;") and wrapper["createdAt"] == wrapper["updatedAt"] == 1_700_000_000_000
    assert views.decode(value) == ("dvc-sweep-single-fp32-bs16-512-3f9a2c", state)
    cards = [c for c in state["compareRunCharts"] if not c["deleted"]]
    assert [c["yaxis"]["key"] for c in cards[:3]] == [m for _, m in views.CHARTS] and cards[3][
        "metricKey"
    ] == "val_loss"
    assert all(c["xaxis"] == {"key": "train.batch_size", "type": "PARAM"} for c in cards[:3])
    hidden = {c["metricKey"] for c in state["compareRunCharts"] if c["deleted"]}
    assert hidden == set(metrics) - {"val_loss"}  # the UI would append a chart for each of those
    assert {c["metricSectionId"] for c in state["compareRunCharts"]} == {s["uuid"] for s in state["compareRunSections"]}
    assert state["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": "sweep.batch_size"}]
    with pytest.raises(ValueError, match="MLflow keeps at most 20000"):
        views.encode(
            "x", views.state("abc", "train.batch_size", "sweep.batch_size", [f"m{i:05d}" for i in range(4000)])
        )


def test_the_newest_batchlab_view_is_the_one_make_ui_opens() -> None:
    def tag(key: str, at: int) -> tuple[str, str]:
        return views.PREFIX + key, views.encode(key, {}, now_ms=at)

    tags = [tag("batchlab-a", 2), tag("batchlab-b", 3), tag("someone-elses", 9), ("mlflow.note.content", "x")]
    assert views.newest(tags) == "batchlab-b" and views.newest([]) is None
    assert views.link("7", "batchlab-b") == "#/experiments/7/runs?viewStateShareKey=batchlab-b&compareRunsMode=CHART"


def _browser() -> str:
    found = next((p for n in ("chromium-headless-shell", "chromium") if (p := shutil.which(n))), None)
    if found is None:
        why = "no headless Chromium: apt-get install chromium-headless-shell (.ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return found


def _dom(url: str, profile: Path) -> str:
    """The MLflow UI's page once its scripts ran and fetched the runs, in a tall window (cards
    outside the viewport are drawn as skeletons)."""
    cmd = [_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={profile}",
           "--window-size=1600,5000", "--virtual-time-budget=60000", "--dump-dom", url]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _cards(dom: str) -> dict[str, str]:
    """Each chart card's title -> its markup."""
    marker = 'data-testid="experiment-view-compare-runs-card"'
    starts = [m.start() for m in re.finditer(re.escape(marker), dom)] + [len(dom)]
    cards = {}
    for start, end in itertools.pairwise(starts):
        card = dom[start:end]
        if title := re.search(r'<h4[^>]*title="([^"]+)"', card):
            cards[title.group(1)] = card
    return cards


@pytest.mark.e2e
def test_make_uis_link_opens_the_sweeps_charts_in_mlflows_own_ui(workdir: Path, tmp_path: Path) -> None:
    """A tiny sweep on a real `mlflow server` (PostgreSQL); `batchlab ui-url` (what `make ui` prints)
    and the parent's description both link the sweep's view, and headless Chromium finds its four
    charts drawn by MLflow's UI from the sweep's children: F1, seconds and steps against batch size
    (one point per batch size: the children grouped), and the val-loss curves."""
    from mlflow import MlflowClient

    from batchlab import stages
    from batchlab.paths import Paths
    from batchlab.sweep.run import run_sweep
    from tests.support import mlflow_on_postgres, run, tiny_config, write_params

    with mlflow_on_postgres(tmp_path) as server:
        track = {"enabled": True, "experiment": "view-test", "registered_model": "", "tracking_uri": server.uri}
        cfg = tiny_config(tracking=track, sweep={"seeds": [0, 1]})
        stages.generate(cfg, Paths(workdir))
        run_sweep(cfg, Paths(workdir))
        client = MlflowClient(server.uri)
        experiment = client.get_experiment_by_name("view-test")
        parent = next(r for r in client.search_runs([experiment.experiment_id]) if r.data.tags.get("sweep") == "parent")
        note = parent.data.tags["mlflow.note.content"]
        link = views.link(experiment.experiment_id, views.key_of(parent.info.run_id))
        assert f"[The study's charts]({link})" in note
        write_params(workdir, cfg.model_dump(mode="json"))
        port = server.uri.rsplit(":", 1)[1]  # as `make ui UI_PORT=<port>` prints it for its own server
        printed = run(["batchlab", "ui-url", "--store", server.store, "--port", port], workdir).stdout.strip()
        assert printed == f"{server.uri}/{link}"  # make ui opens on the view

        dom = _dom(printed, tmp_path / "profile")
    cards = _cards(dom)
    # the UI titles a scatter "x vs. y" and a line chart by its metric
    scatters = [f"train.batch_size vs. {metric}" for _, metric in views.CHARTS]
    assert set(cards) == {*scatters, views.CURVE}, sorted(cards)  # the four, and none the UI made up itself
    for title in cards:
        assert "js-plotly-plot" in cards[title] and 'class="main-svg"' in cards[title], title
    for title in scatters:  # grouped by batch size: one point per batch size (16, 32, 64)
        assert len(re.findall(r'<path class="point[ "]', cards[title])) == 3, title
    # a curve per batch size, each with the band between its seeds (MLflow draws a group's min–max as a fill)
    assert len(re.findall(r'class="trace scatter', cards[views.CURVE])) >= 3
    assert cards[views.CURVE].count('class="js-fill"') >= 3  # (the parent's empty "Unassigned" group may add one)
