"""One typed config, shaped like params.yaml. Loading it has no side effects."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PositiveInt = Annotated[int, Field(gt=0)]


class ConfigError(ValueError):
    """A params file that cannot be used; the message is one line naming the key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DataConfig(Section):
    source: Literal["synthetic", "breast_cancer", "digits", "wine", "iris", "csv"] = Field(
        "synthetic", description="where rows come from: make_classification, a bundled sklearn set, or a CSV"
    )
    samples: PositiveInt = Field(4000, description="synthetic: number of rows")
    features: PositiveInt = Field(10, description="synthetic: number of feature columns")
    informative: PositiveInt = Field(6, description="synthetic: features that carry signal")
    classes: Annotated[int, Field(ge=2)] = Field(2, description="synthetic: number of classes")
    class_sep: Annotated[float, Field(gt=0)] = Field(1.0, description="synthetic: distance between classes")
    label_noise: Annotated[float, Field(ge=0, lt=1)] = Field(0.02, description="synthetic: fraction of flipped labels")
    csv_path: str | None = Field(None, description="csv: path of the file to read")
    target: str = Field("target", description="csv: name of the label column")
    val_fraction: Annotated[float, Field(gt=0, lt=0.5)] = Field(0.15, description="share of rows for validation")
    test_fraction: Annotated[float, Field(gt=0, lt=0.5)] = Field(0.15, description="share of rows for test")
    seed: int = Field(42, description="seed for generation and the split")

    @model_validator(mode="after")
    def _consistent(self) -> DataConfig:
        if self.source == "synthetic" and self.informative > self.features:
            raise ValueError(
                f"data.informative must be at most data.features ({self.features}), got {self.informative}"
            )
        if self.source == "csv" and not self.csv_path:
            raise ValueError("data.csv_path is required when data.source is csv")
        return self


class ModelConfig(Section):
    hidden_sizes: list[PositiveInt] = Field(
        [64, 64], description="width of each hidden layer; [] is a linear model (logistic regression)"
    )
    activation: Literal["relu", "gelu", "tanh", "silu"] = Field("relu", description="hidden activation")
    dropout: Annotated[float, Field(ge=0, lt=1)] = Field(0.1, description="dropout after each hidden layer")


class TrainConfig(Section):
    epochs: PositiveInt = Field(20, description="passes over the train split")
    batch_size: PositiveInt = Field(64, description="global batch: rows per optimizer step over all ranks")
    optimizer: Literal["adam", "adamw", "sgd"] = Field("adamw", description="sgd uses momentum")
    lr: Annotated[float, Field(gt=0)] = Field(3e-3, description="peak learning rate")
    weight_decay: Annotated[float, Field(ge=0)] = Field(1e-4, description="L2 / decoupled weight decay")
    momentum: Annotated[float, Field(ge=0, lt=1)] = Field(0.9, description="sgd momentum")
    schedule: Literal["constant", "cosine"] = Field("cosine", description="cosine = linear warmup, then cosine decay")
    warmup_epochs: Annotated[float, Field(ge=0)] = Field(1.0, description="warmup length for the cosine schedule")
    early_stopping_patience: Annotated[int, Field(ge=0)] = Field(
        5, description="stop after this many epochs without val-loss improvement (0 = off)"
    )
    seed: int = Field(0, description="seed for initial weights, shuffling and dropout")
    threads: Annotated[int, Field(ge=0)] = Field(0, description="torch CPU threads per process; 0 = auto: more "
        "than one only when a step's work (model width x batch) pays for them, on cores no other process is busy on, "
        "within the process's share (sweep.parallel; ddp/fsdp ranks: cores / nproc)")  # fmt: skip
    strategy: Literal["single", "ddp", "fsdp"] = Field(
        "single", description="single process, DistributedDataParallel, or FSDP2 (fully_shard: sharded state)"
    )
    nproc: PositiveInt = Field(1, description="ddp/fsdp: processes per machine")
    nnodes: PositiveInt = Field(1, description="ddp/fsdp: number of machines")
    node_rank: Annotated[int, Field(ge=0)] = Field(0, description="ddp/fsdp: this machine's index")
    rdzv_endpoint: str = Field("127.0.0.1:29500", description="ddp/fsdp: host:port of the rendezvous")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available")
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="autocast dtype; fp16 adds a grad scaler")
    grad_accum_steps: PositiveInt = Field(1, description="micro-batches per optimizer step")
    gns: bool = Field(True, description="measure the gradient noise scale B_simple while training (gns.* metrics)")
    gns_every: PositiveInt | None = Field(None, description="probe the noise scale every this many steps "
        "(null: as often as keeps the probe near 5% of the steps' time; the sweep probes once an epoch)")  # fmt: skip
    eval_every_steps: Annotated[int, Field(ge=0)] = Field(
        0, description="also score the val split every this many optimizer steps (0 = once per epoch only)"
    )
    curve_weights: bool = Field(False, description="keep the weights at those val points (reports/curve_weights.pt)")
    max_nonfinite_steps: PositiveInt = Field(
        20, description="stop after this many consecutive steps with non-finite gradients"
    )
    max_restarts: Annotated[int, Field(ge=0)] = Field(0, description="ddp/fsdp: launcher restarts after a rank fails")
    dist_timeout_s: PositiveInt = Field(300, description="ddp/fsdp: seconds before a stuck collective fails")

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"train.node_rank must be below train.nnodes ({self.nnodes}), got {self.node_rank}")
        if self.strategy == "single" and (self.nproc > 1 or self.nnodes > 1):
            raise ValueError("train.nproc and train.nnodes above 1 need train.strategy: ddp or fsdp")
        per_rank = self.world_size() * self.grad_accum_steps
        if self.batch_size % per_rank:
            raise ValueError(
                f"train.batch_size ({self.batch_size}) must divide by world size x grad_accum_steps ({per_rank})"
            )
        return self

    def world_size(self) -> int:
        return 1 if self.strategy == "single" else self.nproc * self.nnodes


class EvaluateConfig(Section):
    average: Literal["macro", "weighted"] = Field("macro", description="headline average for precision/recall/F1")


class ExportConfig(Section):
    opset: Annotated[int, Field(ge=13, le=23)] = Field(18, description="ONNX opset version")
    atol: Annotated[float, Field(gt=0)] = Field(1e-4, description="max abs logit difference onnxruntime vs torch")
    quantize: Literal["none", "dynamic", "static"] = Field(
        "none",
        description="also write an int8 models/int8/model.int8.onnx: dynamic, or static calibrated on the train split",
    )
    quantize_max_f1_drop: Annotated[float, Field(ge=0, le=1)] = Field(
        0.005, description="int8 gate: the most test-split F1 (macro) it may lose against fp32, or the stage fails"
    )


class TrackingConfig(Section):
    enabled: bool = Field(True, description="record runs in MLflow")
    experiment: str = Field("batchlab", description="MLflow experiment name")
    tracking_uri: str = Field(
        "sqlite:///mlflow.db", description="used unless MLFLOW_TRACKING_URI is set in the environment"
    )
    registered_model: str = Field("batchlab-mlp", description="registry name; empty string = do not register")
    system_metrics: bool = Field(False, description="sample CPU/memory (and GPU) while training")


class SweepConfig(Section):
    batch_sizes: list[PositiveInt] = Field([16, 32, 64, 128, 256, 512], description="global batch sizes to compare")
    lr_scaling: Literal["none", "linear", "sqrt"] = Field(
        "sqrt", description="scale train.lr by batch_size / train.batch_size with this rule"
    )
    epochs: PositiveInt | None = Field(None, description="epochs per experiment (default: train.epochs)")
    seeds: list[int] = Field(
        [0, 1, 2, 3, 4], description="one experiment per batch size and seed (3+ for a CI, 5 to tell batch sizes apart)"
    )
    parallel: PositiveInt = Field(1, description="experiments at once, each in its own process")
    vectorize_seeds: bool = Field(
        True,
        description="train the seeds of one batch size and lr together in one vectorized model (results equal "
        "separate runs within 1e-6); ddp, fp16/bf16, accumulation and CUDA train them one after another",
    )
    lr_multipliers: list[float] = Field(
        [1.0], description="each batch size also runs at these multiples of its scaled lr; the best val loss wins"
    )
    evals_per_epoch: PositiveInt = Field(
        10, description="val-split scores per epoch, to find the step that reaches the target"
    )
    target_val_loss: Annotated[float, Field(gt=0)] | None = Field(
        None, description="val loss that defines 'reached' (null = the lowest every experiment reaches, +2%)"
    )
    memory_budget_mb: Annotated[float, Field(gt=0)] | None = Field(
        None, description="MiB of tensor memory per step: report the largest batch predicted to fit"
    )
    exact_noise_rows: Annotated[int, Field(ge=0)] = Field(
        4096, description="exact noise scale at the target when the train split has at most this many rows (0: never)"
    )
    executor: Literal["local", "dask"] = Field(
        "local", description="local: sweep.parallel processes here; dask: one Prefect task per experiment on a cluster"
    )
    dask_address: str | None = Field(None, description="dask: the scheduler's host:port (tcp://host:port)")

    @field_validator("batch_sizes")
    @classmethod
    def _batch_sizes(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("sweep.batch_sizes must list at least one batch size")
        if len(set(v)) != len(v):
            raise ValueError(f"sweep.batch_sizes has duplicates: {v}")
        return v

    @field_validator("lr_multipliers")
    @classmethod
    def _lr_multipliers(cls, v: list[float]) -> list[float]:
        if not v or any(m <= 0 for m in v) or len(set(v)) != len(v):
            raise ValueError(f"sweep.lr_multipliers must be a non-empty list of distinct positive numbers, got {v}")
        return v

    @model_validator(mode="after")
    def _executor(self) -> SweepConfig:
        if self.executor == "dask" and not self.dask_address:
            raise ValueError("sweep.dask_address is required when sweep.executor is dask (the scheduler's host:port)")
        return self

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v: list[int]) -> list[int]:
        if not v or len(set(v)) != len(v):
            raise ValueError(f"sweep.seeds must be a non-empty list without duplicates, got {v}")
        return v


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
