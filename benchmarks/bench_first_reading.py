"""What a cheaper first noise reading would cost and how true it stays (issue #42: the adaptive
rule's reading before its first step costs more than the fastest fixed batch's whole run on the
transformer). At the initial weights of the default study, the CNN and the transformer, the probe's
reading (training/gns_probes.FullSplitProbe, the finite-population correction as in training) with
its passes over all train rows and over a random 1,024 / 512 / 256 of them, against the exact
B_simple at the same weights: the median ratio over 15 readings (each its own rows and masks)
with its 10-90% range, and the milliseconds a reading takes, side by side in one run, 1 thread.
The rows' own gradients (tr Σ) come from min(rows, ROW_SAMPLE) rows, as the probe takes them."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from batchlab.config import Config
from batchlab.data import build
from batchlab.training import gns_probes
from batchlab.training.gns_exact import exact_noise_scale
from batchlab.training.gns_probes import FullSplitProbe, reading_now
from batchlab.training.train import initial_model, split_tensors
from common import Table, markdown, progress, shipped_params

STUDIES: dict[str, dict[str, Any]] = {
    "default (MLP, synthetic)": {},
    "CNN on digits_images": {"data": {"source": "digits_images"}, "model": {"name": "cnn"}},
    "transformer on sequences": {"data": {"source": "sequences"}, "model": {"name": "transformer"}},
}
ROWS = (None, 1024, 512, 256)  # rows a pass (None: the whole train split, today's probe)
READINGS = 15


def _config(overrides: dict[str, Any]) -> Config:
    return shipped_params(overrides)


def main() -> dict[str, Any]:
    table = Table(
        f"The noise reading at the initial weights against the exact B_simple there, by rows a pass "
        f"({READINGS} readings each; 1 thread)",
        ["study", "exact B_simple", "rows a pass", "reading / exact, median (10–90%)", "ms a reading",
         "vs the whole split's ms", "load"],
    )  # fmt: skip
    raw: dict[str, Any] = {}
    torch.set_num_threads(1)
    whole = gns_probes.FULL_SPLIT_ROWS
    try:
        for name, overrides in STUDIES.items():
            progress(f"first_reading: {name}")
            cfg = _config(overrides)
            dataset = build(cfg.data)[0]
            model = initial_model(cfg, dataset.input_shape, dataset.n_classes, dataset.vocab).train()
            x, y = split_tensors(dataset.train, torch.device("cpu"))
            exact = exact_noise_scale(model, F.cross_entropy, x, y).b_simple
            reference = float("nan")
            for rows in ROWS:
                gns_probes.FULL_SPLIT_ROWS = whole if rows is None else rows
                probe = FullSplitProbe(model, F.cross_entropy, x, y)
                load = os.getloadavg()[0]
                ratios, seconds = [], []
                for step in range(1, READINGS + 1):
                    started = time.perf_counter()
                    reading = reading_now(probe, x.shape[0], 1, step)
                    seconds.append(time.perf_counter() - started)
                    ratios.append(reading.b_simple / exact if reading is not None else float("nan"))
                low, mid, high = np.quantile(ratios, [0.1, 0.5, 0.9])
                ms = 1000 * float(np.median(seconds))
                reference = ms if rows is None else reference
                label = f"all {x.shape[0]}" if rows is None else str(min(rows, x.shape[0]))
                table.add(name, f"{exact:.1f}", label, f"{mid:.2f} ({low:.2f}–{high:.2f})", f"{ms:.0f}",
                          f"{ms / reference:.2f}", f"{load:.2f}")  # fmt: skip
                raw[f"{name}|{label}"] = {"exact": exact, "ratios": ratios, "ms": ms, "load": load}
    finally:
        gns_probes.FULL_SPLIT_ROWS = whole
    tables = [table.as_dict()]
    print(markdown(tables))
    return {"tables": tables, "readings": raw}


if __name__ == "__main__":
    main()
