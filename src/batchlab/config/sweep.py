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
        "batch size to the largest, the same seeds, data, epochs and target, compared paired by seed")
    local_cbs: bool = Field(False, description="also measure the local critical batch size through training: "
        "branch train.batch_size's run at sweep.local_cbs_points with each multiplier (docs/local-cbs.md)")
    local_cbs_points: list[Annotated[float, Field(gt=0, lt=1)]] = Field(
        [0.1, 0.25, 0.5, 0.75], description="local_cbs: where to branch, as fractions of the run's examples (each "
        "snapped to an epoch's end)",
    )
    local_cbs_multipliers: list[PositiveInt] = Field(
        [1, 2, 4, 8, 16], description="local_cbs: each branch's batch is train.batch_size times one of these (1 is "
        "the base branch every other is compared with)",
    )
    local_cbs_fraction: Annotated[float, Field(gt=0, le=1)] = Field(
        0.2, description="local_cbs: the examples each branch trains, as a fraction of the run's (the same for every "
        "multiplier)",
    )
    local_cbs_tolerance: Annotated[float, Field(ge=0, lt=1)] = Field(
        0.1, description="local_cbs: a batch is within the critical batch size while its branch keeps at least "
        "1 - this of the base branch's own fall in val loss (tested over seeds, Holm)",
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

    @field_validator("local_cbs_points")
    @classmethod
    def _local_cbs_points(cls, v: list[float]) -> list[float]:
        if not v or len(set(v)) != len(v):
            raise ValueError(
                f"sweep.local_cbs_points must be a non-empty list of distinct fractions in (0, 1), got {v}"
            )
        return sorted(v)

    @field_validator("local_cbs_multipliers")
    @classmethod
    def _local_cbs_multipliers(cls, v: list[int]) -> list[int]:
        if 1 not in v or len(v) < 2 or len(set(v)) != len(v):
            raise ValueError(f"sweep.local_cbs_multipliers must list 1 (the base branch) and at least one larger "
                             f"multiplier, without duplicates, e.g. [1, 2, 4, 8, 16]; got {v}")
        return sorted(v)

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
