"""A saved MLflow view per sweep: its children, grouped by batch size, as four charts.

MLflow's UI keeps a shared view of the experiment page as an experiment tag,
`mlflow.sharedViewState.<key>`, and opens it from `#/experiments/<id>/runs?viewStateShareKey=<key>
&compareRunsMode=CHART`. The format is the UI's own and not documented; what is written here is
what MLflow 3.17's bundle reads (checked in its JavaScript: the loader takes a JSON wrapper
{name, createdAt, updatedAt, state} whose state is `deflate;` + base64 of zlib-compressed JSON, picks
the search facets and UI-state fields below, and needs both `compareRunCharts` and
`compareRunSections`, or it replaces them with its own). tests/tracking/test_views.py opens the
link in a headless browser against a real `mlflow server` and finds the charts drawn; a new MLflow
release that reads views otherwise fails it there. The tag's value is capped at 20,000 characters.
"""

from __future__ import annotations

import base64
import json
import time
import zlib
from collections.abc import Iterable
from typing import Any

PREFIX = "mlflow.sharedViewState."
DEFLATE = "deflate;"
MAX_VALUE = 20_000  # MLflow's limit on an experiment tag's value (and the UI's on a view)
SECTION = "batchlab-study"

# the scatter charts against the batch size, (card id, y metric): test F1, seconds and steps to the
# target; the UI titles each "train.batch_size vs. <metric>", whatever name the card carries
CHARTS = (
    ("f1", "summary.test_f1_macro"),
    ("seconds", "summary.seconds_to_target"),
    ("steps", "summary.steps_to_target"),
)
CURVE = "val_loss"
SECTION_STATE = {"uuid": SECTION, "name": "Batch-size study", "display": True, "isReordered": False, "deleted": False,
                 "isGenerated": False}


KEY = "batchlab-"  # a batchlab view's key: this, then its sweep's parent run id


def key_of(parent_run_id: str) -> str:
    """One view per sweep, named for its parent run (a rerun that reports again replaces it)."""
    return KEY + parent_run_id


def link(experiment_id: str, key: str) -> str:
    """The view's address relative to the UI; no search facet may ride along, or the UI ignores the view."""
    return f"#/experiments/{experiment_id}/runs?viewStateShareKey={key}&compareRunsMode=CHART"


def state(parent_run_id: str, batch_param: str, batch_tag: str, metrics: Iterable[str]) -> dict[str, Any]:
    """The page's state: the parent's children, grouped by their tag `batch_tag` (mean, with min–max
    bands on the curves; by a tag, not the param, since the UI adds a child's parent to the rows and
    the parent has the param too), three scatter charts of the study's figures against the param
    `batch_param` and the val-loss curves. `metrics`: every metric the children logged; each one not
    charted here gets a deleted card, or the UI appends a chart of its own for it."""
    cards: list[dict[str, Any]] = [
        {"uuid": f"batchlab-{uuid}", "type": "SCATTER", "xaxis": {"key": batch_param, "type": "PARAM"},
         "yaxis": {"key": metric, "type": "METRIC"}, "runsCountToCompare": 100}
        for uuid, metric in CHARTS
    ]
    cards.append({
        "uuid": "batchlab-val-loss", "type": "LINE", "metricKey": CURVE,
        "runsCountToCompare": 100, "lineSmoothness": 0, "xAxisKey": "step", "xAxisScaleType": "linear",
        "scaleType": "log", "selectedXAxisMetricKey": "", "yAxisKey": "metric", "yAxisExpressions": [],
        "ignoreOutliers": False, "useGlobalXaxisKey": False, "useGlobalLineSmoothing": False,
    })
    charted = {CURVE}
    cards += [
        {"uuid": f"batchlab-hidden-{i}", "type": "BAR", "metricKey": m, "deleted": True, "isGenerated": True}
        for i, m in enumerate(sorted(set(metrics) - charted))
    ]
    for card in cards:
        card.setdefault("deleted", False)
        card.setdefault("isGenerated", False)
        card["metricSectionId"] = SECTION
    return {
        # the fixed batch sizes: an adaptive row's train.batch_size is only where it started
        "searchFilter": f"tags.mlflow.parentRunId = '{parent_run_id}' and params.train.adaptive_batch = 'False'",
        "orderByKey": "attributes.start_time",
        "orderByAsc": False,
        "startTime": "ALL",
        "lifecycleFilter": "Active",
        "datasetsFilter": [],
        "modelVersionFilter": "All Runs",
        "runsHiddenMode": "SHOW_ALL",
        "viewMaximized": False,
        "runListHidden": False,
        "isAccordionReordered": False,
        "useGroupedValuesInCharts": True,
        "hideEmptyCharts": True,
        "groupBy": {"aggregateFunction": "average", "groupByKeys": [{"mode": "tag", "groupByData": batch_tag}]},
        "groupsExpanded": {},
        "chartsSearchFilter": "",
        "globalLineChartConfig": {"xAxisKey": "step", "lineSmoothness": 0, "selectedXAxisMetricKey": ""},
        "compareRunSections": [SECTION_STATE],
        "compareRunCharts": cards,
    }


def encode(name: str, view: dict[str, Any], now_ms: int | None = None) -> str:
    """The tag's value, as the UI's Save view writes it."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    packed = DEFLATE + base64.b64encode(zlib.compress(json.dumps(view, separators=(",", ":")).encode())).decode()
    value = json.dumps({"name": name, "createdAt": now_ms, "updatedAt": now_ms, "state": packed})
    if len(value) > MAX_VALUE:
        raise ValueError(f"the sweep's MLflow view takes {len(value)} characters; MLflow keeps at most {MAX_VALUE}")
    return value


def decode(value: str) -> tuple[str, dict[str, Any]]:
    """A view's name and state, read back as the UI reads them."""
    wrapper = json.loads(value)
    packed = wrapper["state"]
    text = zlib.decompress(base64.b64decode(packed.removeprefix(DEFLATE))) if packed.startswith(DEFLATE) else packed
    return wrapper["name"], json.loads(text)


def save(client: Any, parent_run_id: str, name: str, batch_param: str, batch_tag: str) -> str:
    """Write the sweep's view on the parent's experiment; its link relative to the UI."""
    from batchlab.tracking.backend import retry_locked

    parent = retry_locked(client.get_run, parent_run_id)
    experiment = parent.info.experiment_id
    children = retry_locked(
        client.search_runs, [experiment], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'", max_results=1000
    )
    metrics = {key for run in children for key in run.data.metrics}
    key = key_of(parent_run_id)
    retry_locked(
        client.set_experiment_tag,
        experiment,
        PREFIX + key,
        encode(name, state(parent_run_id, batch_param, batch_tag, metrics)),
    )
    return link(experiment, key)


def newest(tags: Iterable[tuple[str, str]]) -> str | None:
    """The key of the newest batchlab view among an experiment's (key, value) tags."""
    found = []
    for key, value in tags:
        if key.startswith(PREFIX + KEY):
            try:
                found.append((json.loads(value)["updatedAt"], key.removeprefix(PREFIX)))
            except (ValueError, KeyError, TypeError):
                continue
    return max(found)[1] if found else None
