"""Precision, accumulation and the Strategy object, in one process."""

from __future__ import annotations

import contextlib

import pytest
import torch

from batchlab.config import ConfigError
from batchlab.data import Dataset, build
from batchlab.training.strategy import Strategy
from batchlab.training.support import check_supported, describe
from batchlab.training.train import fit
from tests.support import tiny_config

CPU = Strategy(torch.device("cpu"))


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max((sa[k] - sb[k]).abs().max().item() for k in sa)


def _test_accuracy(model: torch.nn.Module, ds: Dataset) -> float:
    with torch.no_grad():
        return float((model(torch.from_numpy(ds.test.x)).argmax(1).numpy() == ds.test.y).mean())


@pytest.fixture(scope="module")
def medium() -> Dataset:
    return build(tiny_config(data={"samples": 3000}).data)[0]


def test_gradient_accumulation_2x16_equals_one_batch_of_32(tiny_dataset: Dataset) -> None:
    one = fit(tiny_config(train={"batch_size": 32}), tiny_dataset, CPU).model
    cfg = tiny_config(train={"batch_size": 32, "grad_accum_steps": 2})
    accumulated = fit(cfg, tiny_dataset, Strategy(torch.device("cpu"), grad_accum_steps=2)).model
    assert _max_diff(one, accumulated) < 1e-5


def test_bf16_reaches_fp32_test_accuracy_within_one_point(medium: Dataset) -> None:
    cfg = {"data": {"samples": 3000}, "train": {"epochs": 6}}
    fp32 = fit(tiny_config(**cfg), medium, CPU).model
    bf16 = fit(tiny_config(**cfg), medium, Strategy(torch.device("cpu"), precision="bf16")).model
    assert _max_diff(fp32, bf16) > 0  # it really ran in bf16
    assert abs(_test_accuracy(bf16, medium) - _test_accuracy(fp32, medium)) <= 0.01


def test_fp16_scaler_skips_and_counts_overflowing_steps(medium: Dataset) -> None:
    strategy = Strategy(torch.device("cpu"), precision="fp16")
    strategy.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**28)  # overflows fp16 until it backs off
    result = fit(tiny_config(data={"samples": 3000}, train={"epochs": 3}), medium, strategy)
    assert result.history[0]["nonfinite_steps"] >= 5
    assert result.history[-1]["nonfinite_steps"] == 0
    assert strategy.scaler.get_scale() < 2.0**28
    assert _test_accuracy(result.model, medium) > 0.85


def test_strategy_members_are_safe_on_one_process() -> None:
    model = torch.nn.Linear(3, 2)
    assert CPU.setup(model) is model and model.weight.grad is not None  # a view of the flat buffer
    assert isinstance(CPU.autocast(), contextlib.nullcontext)
    assert not CPU.scaler.is_enabled() and CPU.is_main
    assert [b.tolist() for b in CPU.micro_batches(model, torch.arange(8))] == [list(range(8))]
    ddp = tiny_config(train={"strategy": "ddp", "nproc": 2}).train
    assert describe(ddp) == {"strategy": "ddp", "device": "cpu", "precision": "fp32", "world_size": "2"}


def test_micro_batches_are_disjoint_equal_slices_of_the_global_batch() -> None:
    batch, net = torch.arange(12), torch.nn.Linear(1, 1)
    ranks = [Strategy(torch.device("cpu"), rank=r, world_size=3, grad_accum_steps=2) for r in range(3)]
    chunks = [c for s in ranks for c in s.micro_batches(net, batch)]
    assert torch.equal(torch.cat(chunks), batch) and {len(c) for c in chunks} == {2}


def test_a_strategy_built_for_other_accumulation_is_refused(tiny_dataset: Dataset) -> None:
    with pytest.raises(ValueError, match=r"train\.grad_accum_steps is 2: build it with Strategy\.from_config"):
        fit(tiny_config(train={"grad_accum_steps": 2}), tiny_dataset, CPU)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown on machines without CUDA")
def test_cuda_requested_without_a_gpu_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"train\.device is cuda but torch sees no CUDA device"):
        check_supported(tiny_config(train={"device": "cuda"}).train)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_cuda_training_in_each_precision(medium: Dataset, precision: str) -> None:
    cfg = tiny_config(data={"samples": 3000}, train={"epochs": 4, "device": "cuda", "precision": precision})
    strategy = Strategy.from_config(cfg.train)
    result = fit(cfg, medium, strategy)
    assert strategy.device.type == "cuda" and result.history[-1]["peak_memory_mb"] > 0
    assert _test_accuracy(result.model.cpu(), medium) > 0.85


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_more_cuda_processes_than_gpus_is_a_config_error() -> None:
    n = torch.cuda.device_count() + 1
    cfg = tiny_config(train={"device": "cuda", "strategy": "ddp", "nproc": n, "batch_size": 16 * n})
    with pytest.raises(ConfigError, match=r"train.nproc \(\d+\) is more than the CUDA devices"):
        check_supported(cfg.train)
