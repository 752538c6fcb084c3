"""What this machine can run, decided from the train config alone, before any process starts: the
device, whether the settings are supported, the run's strategy tags, and whether a sweep's seeds
can train together."""

from __future__ import annotations

import sys

import torch

from batchlab.config import Config, ConfigError, TrainConfig


def resolve_device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device is cuda but torch sees no CUDA device; use cpu or auto")
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda")


def check_supported(cfg: TrainConfig) -> None:
    """Reject settings this machine cannot run, before any process is started."""
    device = resolve_device(cfg)
    if device.type != "cuda":
        return
    if cfg.strategy != "single" and cfg.nproc > torch.cuda.device_count():
        raise ConfigError(f"train.nproc ({cfg.nproc}) is more than the CUDA devices here ({torch.cuda.device_count()})")
    if cfg.precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise ConfigError("train.precision bf16 is not supported by this GPU; use fp16 or fp32")
    if cfg.precision == "fp16" and torch.cuda.get_device_capability() < (5, 3):
        raise ConfigError("train.precision fp16 needs a GPU of compute capability 5.3 or newer; use fp32")


def describe(cfg: TrainConfig) -> dict[str, str]:
    """The strategy as run tags: what the launcher decides, before any rank exists."""
    return {"strategy": cfg.strategy, "precision": cfg.precision, "device": resolve_device(cfg).type,
            "world_size": str(cfg.world_size())}


def seeds_train_apart(config: Config) -> str | None:
    """Why the seeds of one sweep group cannot train together in one vectorized model
    (seeds/vectorized.py), or None when they can: one process, fp32, no accumulation, on the CPU.
    Any model may: the MLP through its own kernels, any other through vmap; what the config cannot
    tell (a model.factory's BatchNorm) is found on the built model, whose seeds then train one
    after another saying why (vectorized.model_trains_apart)."""
    cfg = config.train
    if cfg.adaptive_batch:
        return "train.adaptive_batch: each seed's batch follows its own noise-scale readings"
    if cfg.strategy != "single":  # fsdp on one process still keeps sharded (DCP) checkpoints
        return f"train.strategy {cfg.strategy} with {cfg.world_size()} ranks trains one model per process group"
    if cfg.precision != "fp32":
        return f"train.precision {cfg.precision}: the vectorized path is checked equal to separate runs in fp32 only"
    if cfg.grad_accum_steps > 1:
        return "train.grad_accum_steps > 1: the vectorized path takes one batch per step"
    if resolve_device(cfg).type != "cpu":
        return "a CUDA device: the vectorized path is checked equal to separate runs on the CPU only"
    return None


def main(argv: list[str]) -> int:
    """`python -m batchlab.training.support TRAIN_JSON`: check_supported on this machine (what
    `batchlab validate` runs, away from its own torch-free process)."""
    try:
        check_supported(TrainConfig.model_validate_json(argv[0]))
    except ConfigError as err:
        print(f"batchlab: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
