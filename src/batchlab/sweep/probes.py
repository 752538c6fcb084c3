"""What a sweep measures once per batch size, apart from its experiments: the tensor memory of one
training step (its speed: the throughput table, speeds.py)."""

from __future__ import annotations

from batchlab.config import Config, parse_config
from batchlab.training import memory
from batchlab.training.support import resolve_device

_STEP_MEMORY: dict[str, dict[str, float]] = {}


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
