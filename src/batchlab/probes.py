"""What a sweep measures once per batch size, apart from its experiments: the tensor memory of one
training step, and the speed of one training alone."""

from __future__ import annotations

import statistics

from batchlab import data, memory
from batchlab.config import Config, parse_config
from batchlab.strategy import Strategy, resolve_device

SPEED_EPOCHS = 3  # the probe's epochs: the median of three, as an experiment's figure is a median

_STEP_MEMORY: dict[str, float] = {}
_SOLO_SPEED: dict[str, dict[str, float]] = {}


def step_memory(cfg: Config, n_features: int, n_classes: int) -> float:
    """The tensor peak of one step: the same for every seed and lr, so measured once per batch size."""
    raw = cfg.model_dump()
    raw["train"].update(seed=0, lr=1.0)  # neither moves the memory
    key = parse_config(raw).section_hash("model", "train") + f"-{n_features}-{n_classes}"
    if key not in _STEP_MEMORY:
        batch = cfg.train.batch_size // cfg.train.world_size()  # one process's share
        _STEP_MEMORY[key] = memory.step_memory_mib(cfg, n_features, n_classes, batch, resolve_device(cfg.train))
    return _STEP_MEMORY[key]


def solo_speed(cfg: Config, dataset: data.Dataset) -> dict[str, float]:
    """samples_per_s and epoch_seconds of one training alone at cfg's batch size and lr: the medians
    of a SPEED_EPOCHS-epoch fit() in this process, once per batch size and lr. Seeds trained together
    share their wall time, and what they save grows as the batch shrinks (5 seeds cost 1.85x one at
    batch 16, 2.6x at 64), so a seed's share would flatter small batches against large ones."""
    from batchlab.train import fit

    raw = cfg.model_dump()
    raw["train"].update(seed=0, epochs=SPEED_EPOCHS, early_stopping_patience=0)
    probe = parse_config(raw)
    key = probe.section_hash("model", "train") + f"-{dataset.content_hash()}"
    if key not in _SOLO_SPEED:
        history = fit(probe, dataset, Strategy(resolve_device(probe.train))).history
        _SOLO_SPEED[key] = {k: statistics.median(h[k] for h in history) for k in ("samples_per_s", "epoch_seconds")}
    return _SOLO_SPEED[key]
