"""params.yaml's sweep section: the batch-size study."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from batchlab.config.sections import PositiveInt, Section


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
        "separate runs: the MLP bit for bit, any other module within 1e-5); ddp, fp16/bf16, accumulation, CUDA "
        "and models with batch statistics train them one after another",
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
    adaptive: bool = Field(False, description="add an adaptive row: train.adaptive_batch from the smallest "
        "batch size to the largest, the same seeds, data, epochs and target, compared paired by seed")  # fmt: skip
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
