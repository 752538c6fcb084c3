"""One typed config, shaped like params.yaml. Loading it has no side effects.

sections   every section but the sweep's: each key typed, with its one-line description
sweep      the sweep section (the batch-size study)
"""

from __future__ import annotations

import hashlib
import json
import reprlib
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


# a value in an error message: its first items and levels, one short line (never a page of repr, nor
# the 10**12 items of YAML anchors referring to anchors)
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict, _SHOWN.maxset, _SHOWN.maxstring, _SHOWN.maxother = 3, 6, 6, 6, 80, 80
MAX_VALUES, MAX_DEPTH = 10_000, 32  # far above any params.yaml (the repo's: ~130 values, 3 deep)


def _shown(value: Any) -> str:
    return _SHOWN.repr(value)


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    msg = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        return f"unknown key {loc!r} in params (check spelling; see params.yaml for the allowed keys)"
    if first["type"] == "literal_error":
        return f"{loc}: {msg}, got {_shown(first.get('input'))}"
    if msg.startswith(("data.", "model.", "train.", "sweep.", "export.", "tracking.", "evaluate.")):
        return msg
    return f"{loc}: {msg}, got {_shown(first.get('input'))}" if loc else msg


def parse_config(raw: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`{"train.lr": 0.01}` style overrides, the same keys `dvc exp run -S` takes."""
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in raw.items()}
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
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(err)}") from None
    except RecursionError:  # PyYAML's parser recurses once per level of nesting
        raise ConfigError(f"{path} nests too deeply to read; params.yaml is sections of keys") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must be a mapping of sections (data, model, train, ...), got {_shown(raw)}")
    _check_size(raw, path.name)
    _check_sections(raw, path.name)
    return parse_config(apply_overrides(raw, overrides or {}))


def _yaml_problem(err: yaml.YAMLError) -> str:
    """What PyYAML found wrong and where, in one line (its text opens with the context, not the problem)."""
    problem, mark = getattr(err, "problem", None), getattr(err, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _check_size(raw: dict[str, Any], name: str) -> None:
    """Refuse a document nested deeper than MAX_DEPTH or holding more than MAX_VALUES values once
    its aliases are expanded (an anchor of ten aliases of an anchor of ten ...: a few lines, 10**12
    values), before validating, hashing or printing it walks them all."""
    stack: list[tuple[Any, int]] = [(raw, 1)]
    seen = 0
    while stack:
        value, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise ConfigError(f"{name} holds over {MAX_VALUES} values once its YAML aliases are expanded "
                              "(anchors referring to anchors?); params.yaml is sections of plain keys")
        if depth > MAX_DEPTH:
            raise ConfigError(f"{name} nests values over {MAX_DEPTH} levels deep; params.yaml is sections of keys")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list | set):
            stack.extend((v, depth + 1) for v in value)


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
            raise ConfigError(f"{name}: section {section!r} must be a mapping of keys, got {_shown(raw[section])}")


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(), sort_keys=False)
