"""What a sweep measures once per batch size, apart from its experiments: the tensor memory of one
training step, and the speed of one training alone."""

from __future__ import annotations

from dataclasses import replace

from batchlab import data
from batchlab.config import Config, parse_config
from batchlab.data import Split
from batchlab.training import memory
from batchlab.training.strategy import Strategy
from batchlab.training.support import resolve_device

# The speed probe: after one warm-up window, the fastest of SPEED_WINDOWS windows of
# SPEED_WINDOW_STEPS optimizer steps (an epoch over that many batches of the train split's first
# rows: a step's cost does not depend on which rows it takes). A busy machine only ever slows a
# window down, so the fastest is the least disturbed. It replaced the fastest of 10 full epochs,
# which cost a 10-epoch training per batch size (5 seeds at batch 32 took 2.59x one seed by the
# sweep's wall figure, 1.62x for the seeds alone); the median of 3 epochs before that swung ±15%.
SPEED_WINDOW_STEPS = 25
SPEED_WINDOWS = 6

_STEP_MEMORY: dict[str, dict[str, float]] = {}
_SOLO_SPEED: dict[str, dict[str, float]] = {}


def step_memory(cfg: Config, input_shape: tuple[int, ...], n_classes: int, vocab: int = 0) -> dict[str, float]:
    """The tensor peak of the largest step training takes (`step_memory_mib`: one on which the noise
    probe measures, when train.gns is on) and of a step without it (`step_memory_plain_mib`). The
    same for every seed and lr, so measured once per batch size."""
    raw = cfg.model_dump()
    raw["train"].update(seed=0, lr=1.0)  # neither moves the memory
    key = parse_config(raw).section_hash("model", "train") + f"-{input_shape}-{n_classes}-{vocab}"
    if key not in _STEP_MEMORY:
        batch = cfg.train.batch_size // cfg.train.world_size()  # one process's share
        device = resolve_device(cfg.train)
        plain, probing = memory.step_memories(cfg, input_shape, n_classes, batch, device, vocab)
        _STEP_MEMORY[key] = {
            "step_memory_mib": max(plain, probing) if cfg.train.gns else plain,
            "step_memory_plain_mib": plain,
        }
    return _STEP_MEMORY[key]


def solo_speed(cfg: Config, dataset: data.Dataset) -> dict[str, float]:
    """samples_per_s and epoch_seconds (per full epoch of the train split) of one training alone at
    cfg's batch size and lr, measured in a bounded number of steps: the fastest of SPEED_WINDOWS
    windows after a warm-up one, once per batch size and lr. Seeds trained together share their
    wall time, and what they save grows as the batch shrinks (5 seeds cost 1.4x one at batch 16,
    1.75x at 64), so a seed's share would flatter small batches against large ones. The steps
    alone: without the noise probe (its period keeps it near the same share at every batch size,
    and over a window of rows it would pass over the window, not the train split) and without
    keeping weights."""
    from batchlab.training.train import fit

    raw = cfg.model_dump()
    raw["train"].update(seed=0, epochs=1 + SPEED_WINDOWS, early_stopping_patience=0, eval_every_steps=0)
    raw["train"].update(gns=False, gns_every=None, curve_weights=False)
    probe = parse_config(raw)
    key = probe.section_hash("model", "train") + f"-{dataset.content_hash()}"
    if key not in _SOLO_SPEED:
        rows = min(dataset.train.y.shape[0], probe.train.batch_size * SPEED_WINDOW_STEPS)
        window = replace(dataset, train=Split(dataset.train.x[:rows], dataset.train.y[:rows]))
        history = fit(probe, window, Strategy(resolve_device(probe.train))).history[1:]  # the first warms up
        fastest = max(h["samples_per_s"] for h in history)
        _SOLO_SPEED[key] = {"samples_per_s": fastest, "epoch_seconds": dataset.train.y.shape[0] / fastest}
    return _SOLO_SPEED[key]
