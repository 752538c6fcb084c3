"""One typed config, shaped like params.yaml. Loading it has no side effects.

sections   every section but the sweep's: each key typed, with its one-line description
sweep      the sweep section (the batch-size study)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError, model_validator

from batchlab.config.sections import (
    DataConfig,
    EvaluateConfig,
    ExportConfig,
    ModelConfig,
    PositiveInt,
    Section,
    TrackingConfig,
    TrainConfig,
)
from batchlab.config.sweep import SweepConfig

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "EvaluateConfig",
    "ExportConfig",
    "ModelConfig",
    "PositiveInt",
    "Section",
    "SweepConfig",
    "TrackingConfig",
    "TrainConfig",
    "apply_overrides",
    "dump_config",
    "load_config",
    "parse_config",
]


class ConfigError(ValueError):
    """A params file that cannot be used; the message is one line naming the key."""


class Config(Section):
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    export: ExportConfig = ExportConfig()
    tracking: TrackingConfig = TrackingConfig()
    sweep: SweepConfig = SweepConfig()

    @model_validator(mode="after")
    def _sweep_fits_strategy(self) -> Config:
        per_rank = self.train.world_size() * self.train.grad_accum_steps
        bad = [b for b in self.sweep.batch_sizes if b % per_rank]
        if bad:
            raise ValueError(f"sweep.batch_sizes {bad} must divide by world size x grad_accum_steps ({per_rank})")
        return self

    def flat(self) -> dict[str, Any]:
        """Every key as `section.key` -> value, for tracking params."""
        out: dict[str, Any] = {}
        for section, values in self.model_dump().items():
            for key, value in values.items():
                out[f"{section}.{key}"] = value
        return out

    def section_hash(self, *sections: str) -> str:
        """Content hash of the named sections: identifies a checkpoint or cache entry."""
        dump = self.model_dump(include=set(sections))
        return hashlib.sha256(json.dumps(dump, sort_keys=True).encode()).hexdigest()[:16]


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    msg = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        return f"unknown key {loc!r} in params (check spelling; see params.yaml for the allowed keys)"
    if first["type"] == "literal_error":
        return f"{loc}: {msg}, got {first.get('input')!r}"
    if msg.startswith(("data.", "model.", "train.", "sweep.", "export.", "tracking.", "evaluate.")):
        return msg
    return f"{loc}: {msg}, got {first.get('input')!r}" if loc else msg


def parse_config(raw: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`{"train.lr": 0.01}` style overrides, the same keys `dvc exp run -S` takes."""
    out = {section: dict(values) for section, values in raw.items()}
    for dotted, value in overrides.items():
        section, _, key = dotted.partition(".")
        if not key:
            raise ConfigError(f"override {dotted!r} must be section.key, e.g. train.lr")
        out.setdefault(section, {})[key] = value
    return out


def load_config(path: str | Path = "params.yaml", overrides: dict[str, Any] | None = None) -> Config:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"params file {str(path)!r} not found (run from the repo root or pass --params)")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must be a mapping of sections (data, model, train, ...)")
    _check_sections(raw, path.name)
    return parse_config(apply_overrides(raw, overrides or {}))


def _check_sections(raw: dict[str, Any], name: str) -> None:
    """Every section must be in the file: DVC reads its params keys from it, and a section left out
    would silently train on built-in defaults. (parse_config fills gaps: tests build partial dicts.)"""
    sections = list(Config.model_fields)
    missing = [s for s in sections if s not in raw]
    if missing:
        listed = ", ".join(repr(s) for s in missing)
        raise ConfigError(
            f"{name} has no {listed} section{'s' if len(missing) > 1 else ''}; every section "
            f"({', '.join(sections)}) must be present (see params.yaml in the repo)"
        )
    for section in sections:
        if not isinstance(raw[section], dict):
            raise ConfigError(f"{name}: section {section!r} must be a mapping of keys, got {raw[section]!r}")


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(), sort_keys=False)
