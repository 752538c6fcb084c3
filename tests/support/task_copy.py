"""One copy of a sweep task, as a Dask worker runs it: `python -m tests.support.task_copy FOLDER
PARENT_RUN_ID NAMES OUT` trains (or finds committed) the experiments NAMES (comma-separated) of the
sweep in FOLDER under the parent run, and writes their result rows to OUT."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from batchlab import atomic, data
from batchlab.config import load_config
from batchlab.paths import Paths
from batchlab.sweep import groups
from batchlab.sweep.plan import plan
from batchlab.sweep.tasks import Experiments, Lane


def main(folder: str, parent_run_id: str, names: str, out: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = load_config(Path(folder) / "params.yaml")
    wanted = names.split(",")
    paths = Paths(Path(folder))
    everything = plan(cfg, int(data.load(paths.data).train.y.shape[0]))
    experiments = tuple(e for e in everything if e.name in wanted)
    assert [e.name for e in experiments] == wanted, [e.name for e in everything]
    rows = groups.train_work(Lane(cfg, paths, parent_run_id), Experiments(experiments))
    atomic.write_json(out, rows)


if __name__ == "__main__":
    main(*sys.argv[1:])
