from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from batchlab.config import ConfigError, load_config, parse_config
from tests.support import REPO, TINY, merge


def test_real_params_yaml_loads_with_every_section() -> None:
    cfg = load_config(REPO / "params.yaml")
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    assert set(raw) == {"data", "model", "train", "evaluate", "export", "tracking", "sweep"}
    # params.yaml spells out every key, so a reader sees all the knobs
    for section, values in raw.items():
        assert set(values) == set(getattr(cfg, section).model_dump()), section
    assert cfg.train.world_size() == 1


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"train": {"batch_sise": 3}}, "unknown key 'train.batch_sise'"),
        ({"train": {"batch_size": -3}}, "train.batch_size: Input should be greater than 0, got -3"),
        ({"train": {"optimizer": "lbfgs"}}, "train.optimizer: Input should be 'adam', 'adamw' or 'sgd', got 'lbfgs'"),
        ({"data": {"source": "mnist"}}, "data.source: Input should be"),
        ({"data": {"informative": 20}}, "data.informative must be at most data.features (8), got 20"),
        ({"train": {"strategy": "ddp", "nproc": 2, "batch_size": 33}}, "train.batch_size (33) must divide"),
        ({"train": {"nproc": 2}}, "need train.strategy: ddp"),
        ({"sweep": {"batch_sizes": []}}, "sweep.batch_sizes must list at least one batch size"),
        ({"sweep": {"batch_sizes": [32, 32]}}, "sweep.batch_sizes has duplicates: [32, 32]"),
        ({"sweep": {"batch_sizes": [0, 32]}}, "sweep.batch_sizes.0: Input should be greater than 0"),
        ({"data": {"source": "csv"}}, "data.csv_path is required"),
        ({"sweep": {"lr_multipliers": []}}, "sweep.lr_multipliers must be a non-empty list of distinct positive"),
        ({"sweep": {"lr_multipliers": [0.5, -1]}}, "sweep.lr_multipliers must be a non-empty list"),
        ({"sweep": {"memory_budget_mb": 0}}, "sweep.memory_budget_mb: Input should be greater than 0, got 0"),
        ({"sweep": {"target_val_loss": -0.1}}, "sweep.target_val_loss: Input should be greater than 0"),
        ({"train": {"eval_every_steps": -1}}, "train.eval_every_steps: Input should be greater than or equal to 0"),
    ],
)
def test_bad_values_give_one_line_error_naming_the_key(override: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(merge(TINY, override))
    text = str(err.value)
    assert message in text
    assert "\n" not in text


def test_config_is_frozen_and_flattens_for_tracking() -> None:
    cfg = parse_config(TINY)
    with pytest.raises(ValueError):
        cfg.train.lr = 1.0  # type: ignore[misc]
    flat = cfg.flat()
    assert flat["train.batch_size"] == 32
    assert flat["model.hidden_sizes"] == [16]


def test_missing_or_malformed_params_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def _real_params() -> dict[str, Any]:
    return yaml.safe_load((REPO / "params.yaml").read_text())


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ("", "params.yaml has no 'data', 'model', 'train', 'evaluate', 'export', 'tracking', 'sweep' sections"),
        ({k: v for k, v in _real_params().items() if k != "train"}, "params.yaml has no 'train' section;"),
        ({**_real_params(), "train": None}, "params.yaml: section 'train' must be a mapping of keys, got None"),
    ],
)
def test_a_missing_section_is_an_error_not_the_defaults(tmp_path: Path, params: object, message: str) -> None:
    path = tmp_path / "params.yaml"
    path.write_text(params if isinstance(params, str) else yaml.safe_dump(params))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    text = str(err.value)
    assert message in text and "\n" not in text
    if "has no" in message:
        assert "every section (data, model, train, evaluate, export, tracking, sweep) must be present" in text


def test_loading_config_has_no_side_effects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(merge(_real_params(), TINY)))
    load_config()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


def test_dask_executor_needs_a_scheduler_address() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(merge(TINY, {"sweep": {"executor": "dask"}}))
    assert str(err.value) == "sweep.dask_address is required when sweep.executor is dask (the scheduler's host:port)"
    cfg = parse_config(merge(TINY, {"sweep": {"executor": "dask", "dask_address": "tcp://127.0.0.1:8786"}}))
    assert cfg.sweep.dask_address == "tcp://127.0.0.1:8786"
    with pytest.raises(ConfigError, match=r"sweep\.executor"):
        parse_config(merge(TINY, {"sweep": {"executor": "ray"}}))
