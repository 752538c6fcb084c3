"""What a sweep measures once per batch size, apart from its experiments: the tensor memory of one
training step, and the speed of one training alone."""

from __future__ import annotations

from batchlab import data
from batchlab.config import Config, parse_config
from batchlab.training import memory
from batchlab.training.strategy import Strategy
from batchlab.training.support import resolve_device

# The probe's epochs; it reports the fastest (a busy machine only ever slows an epoch down). Measured
# here, 4 reruns each: the median of 3 epochs swung ±15% (batch 64: 64k-86k samples/s) and flipped
# the recommended batch size between 32 and 64; the fastest of 10 stayed within ±5% (81k-92k), at
# ~1.5 s more per study
SPEED_EPOCHS = 10

_STEP_MEMORY: dict[str, dict[str, float]] = {}
_SOLO_SPEED: dict[str, dict[str, float]] = {}


def step_memory(cfg: Config, n_features: int, n_classes: int) -> dict[str, float]:
    """The tensor peak of the largest step training takes (`step_memory_mib`: one on which the noise
    probe measures, when train.gns is on) and of a step without it (`step_memory_plain_mib`). The
    same for every seed and lr, so measured once per batch size."""
    raw = cfg.model_dump()
    raw["train"].update(seed=0, lr=1.0)  # neither moves the memory
    key = parse_config(raw).section_hash("model", "train") + f"-{n_features}-{n_classes}"
    if key not in _STEP_MEMORY:
        batch = cfg.train.batch_size // cfg.train.world_size()  # one process's share
        device = resolve_device(cfg.train)
        plain = memory.step_memory_mib(cfg, n_features, n_classes, batch, device)
        probing = memory.step_memory_mib(cfg, n_features, n_classes, batch, device, probing=True)
        _STEP_MEMORY[key] = {
            "step_memory_mib": max(plain, probing) if cfg.train.gns else plain,
            "step_memory_plain_mib": plain,
        }
    return _STEP_MEMORY[key]


def solo_speed(cfg: Config, dataset: data.Dataset) -> dict[str, float]:
    """samples_per_s and epoch_seconds of one training alone at cfg's batch size and lr: its fastest
    epoch of a SPEED_EPOCHS-epoch fit() in this process, once per batch size and lr. Seeds trained
    together share their wall time, and what they save grows as the batch shrinks (5 seeds cost 1.4x
    one at batch 16, 1.75x at 64), so a seed's share would flatter small batches against large ones."""
    from batchlab.training.train import fit

    raw = cfg.model_dump()
    raw["train"].update(seed=0, epochs=SPEED_EPOCHS, early_stopping_patience=0)
    probe = parse_config(raw)
    key = probe.section_hash("model", "train") + f"-{dataset.content_hash()}"
    if key not in _SOLO_SPEED:
        history = fit(probe, dataset, Strategy(resolve_device(probe.train))).history
        fastest = max(history, key=lambda h: h["samples_per_s"])
        _SOLO_SPEED[key] = {k: fastest[k] for k in ("samples_per_s", "epoch_seconds")}
    return _SOLO_SPEED[key]
