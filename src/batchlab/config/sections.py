"""The sections of params.yaml but the sweep's (sweep.py): each key typed, with its one-line description."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PositiveInt = Annotated[int, Field(gt=0)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Source = Literal["synthetic", "breast_cancer", "digits", "wine", "iris", "csv", "npz", "digits_images", "sequences"]


class DataConfig(Section):
    source: Source = Field("synthetic", description="where examples come from: make_classification, a "
        "bundled sklearn set, a CSV, your own arrays (npz), the digits as 1x8x8 images, or token ids")
    samples: PositiveInt = Field(4000, description="synthetic: number of rows")
    features: PositiveInt = Field(10, description="synthetic: number of feature columns")
    informative: PositiveInt = Field(6, description="synthetic: features that carry signal")
    classes: Annotated[int, Field(ge=2)] = Field(2, description="synthetic: number of classes")
    class_sep: Annotated[float, Field(gt=0)] = Field(1.0, description="synthetic: distance between classes")
    label_noise: Annotated[float, Field(ge=0, lt=1)] = Field(0.02, description="synthetic: fraction of flipped labels")
    csv_path: str | None = Field(None, description="csv: path of the file to read")
    target: str = Field("target", description="csv: name of the label column")
    npz_path: str | None = Field(None, description="npz: an .npz under data/raw/ with x (N, ...) and y (N labels)")
    seq_len: PositiveInt = Field(16, description="sequences: tokens per example")
    vocab: Annotated[int, Field(ge=2)] = Field(8, description="sequences: token ids 0 .. vocab-1")
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
        if self.source == "npz" and not self.npz_path:
            raise ValueError("data.npz_path is required when data.source is npz (an .npz with arrays x and y)")
        if self.source == "sequences" and self.classes > self.vocab:
            raise ValueError(f"data.classes ({self.classes}) must be at most data.vocab ({self.vocab}) for sequences")
        return self


class ModelConfig(Section):
    name: Literal["mlp", "cnn", "transformer"] = Field(
        "mlp", description="built-in network: mlp (rows), cnn (images C x H x W), transformer (token sequences)"
    )
    hidden_sizes: list[PositiveInt] = Field(
        [64, 64], description="mlp: width of each hidden layer; [] is a linear model (logistic regression)"
    )
    activation: Literal["relu", "gelu", "tanh", "silu"] = Field("relu", description="hidden activation")
    dropout: Annotated[float, Field(ge=0, lt=1)] = Field(0.1, description="dropout after each hidden layer")
    channels: list[PositiveInt] = Field([16, 32], description="cnn: channels of each 3x3 conv + 2x2 max-pool block")
    d_model: PositiveInt = Field(32, description="transformer: embedding width (a multiple of model.heads)")
    heads: PositiveInt = Field(4, description="transformer: attention heads")
    layers: PositiveInt = Field(2, description="transformer: encoder layers (pre-norm, mean-pooled, linear head)")
    factory: str | None = Field(None, description="your own network instead: 'module.path:function', called "
        "as function(input_shape=(...), n_classes=K, **model.kwargs): a module giving (batch, K) logits")
    kwargs: dict[str, Any] = Field({}, description="model.factory: its keyword arguments")

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        if self.name == "transformer" and self.d_model % self.heads:
            raise ValueError(f"model.d_model ({self.d_model}) must divide by model.heads ({self.heads})")
        if self.factory is not None and (self.factory.count(":") != 1 or not all(self.factory.split(":"))):
            raise ValueError(f"model.factory must be 'module.path:function', got {self.factory!r}")
        if self.kwargs and self.factory is None:
            raise ValueError("model.kwargs is for model.factory; the built-in models take their own keys")
        return self

    def is_mlp(self) -> bool:
        """The built-in MLP: what the hand-written seed kernels, FSDP's per-Linear plan and the width
        FLOP count know."""
        return self.factory is None and self.name == "mlp"


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
        "within the process's share (sweep.parallel; ddp/fsdp ranks: cores / nproc)")
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
    fsdp_units: list[str] = Field([], description="fsdp: module classes sharded one by one (e.g. "
        "[TransformerEncoderLayer]); [] = each child of the model that holds parameters but the last")
    gns: bool = Field(True, description="measure the gradient noise scale B_simple while training (gns.* metrics)")
    gns_every: PositiveInt | None = Field(None, description="probe the noise scale every this many steps "
        "(null: as often as keeps the probe near 5% of the steps' time; the sweep probes once an epoch)")
    eval_every_steps: Annotated[int, Field(ge=0)] = Field(
        0, description="also score the val split every this many optimizer steps (0 = once per epoch only)"
    )
    curve_weights: bool = Field(False, description="keep the weights at those val points (reports/curve_weights.pt)")
    adaptive_batch: bool = Field(False, description="grow the batch by integer factors while training as the "
        "measured noise scale rises (docs/adaptive.md); train.batch_size starts it")
    max_batch_size: PositiveInt | None = Field(None, description="adaptive_batch: the cap (null: the train split)")
    adapt_rule: Literal["time", "statistical", "schedule"] = Field("time", description="adaptive_batch: time = "
        "the batch that reaches a loss soonest, S(B)·t(B) on the measured step time; statistical: steps + "
        "examples; schedule: train.adapt_schedule (the sweep's measured local CBS(t))")
    adapt_schedule: list[tuple[Annotated[float, Field(ge=0, lt=1)], PositiveInt]] | None = Field(None,
        description="adaptive_batch, schedule rule: [[share of the run's examples, batch], ...]: from each share "
        "on, the largest batch reachable by doubling up to that one (docs/local-cbs.md)")
    adapt_every_examples: PositiveInt | None = Field(
        None, description="adaptive_batch: decide every this many examples seen (null: one epoch of the train split)"
    )
    adapt_step_time: list[Annotated[float, Field(ge=0)]] | None = Field(None, description="adaptive_batch, time "
        "rule: [a, b, p]: seconds a step = a + b·batch, p a noise probe (null: timed as training starts)")
    adapt_threshold: Annotated[float, Field(ge=0, lt=1)] = Field(
        0.05, description="adaptive_batch: grow only when that saves more than this fraction (of the time to a "
        "loss, or of steps + examples), at the reading's lower 95% bound"
    )
    adapt_lr_scaling: Literal["none", "linear", "sqrt"] = Field(
        "sqrt", description="adaptive_batch: the lr's rescaling at each change (the sweep sets sweep.lr_scaling)"
    )
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
        if self.adaptive_batch:
            self._adaptive_consistent()
        return self

    def _adaptive_consistent(self) -> None:
        if self.max_batch_size is not None and self.max_batch_size < self.batch_size:
            raise ValueError(
                f"train.max_batch_size ({self.max_batch_size}) is below train.batch_size ({self.batch_size}), "
                "where the adaptive batch starts: raise it or leave it null (the train split)"
            )
        if not self.gns and self.adapt_rule != "schedule":
            raise ValueError("train.adaptive_batch reads the measured noise scale: set train.gns: true")
        shares = [share for share, _ in self.adapt_schedule or []]
        batches = [batch for _, batch in self.adapt_schedule or []]
        if shares != sorted(set(shares)) or batches != sorted(batches):
            raise ValueError(f"train.adapt_schedule must rise: shares of the run's examples in [0, 1), increasing, "
                             f"each with a batch no smaller than the last; got {self.adapt_schedule}")
        if self.strategy == "fsdp":
            raise ValueError("train.adaptive_batch needs the noise probe, which FSDP has not: use single or ddp")
        step_time = self.adapt_step_time
        if step_time is not None and (len(step_time) not in (2, 3) or sum(step_time[:2]) <= 0):
            raise ValueError(
                f"train.adapt_step_time must be [a, b] or [a, b, p] (seconds per step = a + b x batch, not both "
                f"0; p: seconds per noise probe), got {step_time}"
            )

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
