"""Every params value that changes what the pipeline writes, through `dvc repro` itself: each
strategy, each precision, gradient accumulation, the adaptive batch in training and in the study,
the local critical batch size and a user's model. DVC checks a stage's declared outputs only after
its command has run, so an output written on some params paths only fails the user after the whole
sweep (the sweep declared reports/sweep/throughput.json, which DDP and FSDP never wrote). Each run
here ends with every output that dvc.yaml declares present and `dvc status` clean: the check reads
dvc.yaml, so a new output is held on every path here without a line of this file changing.

Tiny data, two batch sizes, one seed: the values are combined so that three runs carry them all
(local_cbs branches on one process without fp16's scaler, so it rides with single fp32)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.support import run, set_params

SWEEP = {"batch_sizes": [16, 64], "seeds": [0], "epochs": 2}
OWN_MODEL = "single-fp32-adaptive-local-cbs-own-model"
MATRIX: dict[str, dict[str, dict[str, Any]]] = {
    OWN_MODEL: {  # usermodels/residual.py: a residual CNN with GroupNorm, not a Sequential, on images
        "train": {"adaptive_batch": True, "max_batch_size": 128},
        "data": {"source": "digits_images"},
        "model": {"factory": "usermodels.residual:build", "kwargs": {"width": 8}},
        "sweep": {
            "seeds": [0, 1],
            "adaptive": True,
            "local_cbs": True,
            "local_cbs_points": [0.5],
            "local_cbs_multipliers": [1, 2],
        },
    },
    "ddp-bf16-accumulation": {"train": {"strategy": "ddp", "nproc": 2, "precision": "bf16", "grad_accum_steps": 2}},
    "fsdp-fp16": {"train": {"strategy": "fsdp", "nproc": 2, "precision": "fp16"}},
}


def declared_outputs(dvc_yaml: Path) -> dict[str, list[str]]:
    """Every path each stage of dvc.yaml declares (outs, metrics, plots)."""
    stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
    declared = {}
    for name, stage in stages.items():
        entries = [e for kind in ("outs", "metrics", "plots") for e in stage.get(kind, [])]
        declared[name] = [e if isinstance(e, str) else next(iter(e)) for e in entries]
    return declared


def test_declared_outputs_reads_every_stage_of_dvc_yaml() -> None:
    """The check below sees the sweep's report files and every other stage's, as dvc.yaml lists them."""
    declared = declared_outputs(Path(__file__).resolve().parents[2] / "dvc.yaml")
    assert set(declared) == {"validate", "generate", "train", "evaluate", "export", "sweep"}
    assert "reports/sweep/throughput.json" in declared["sweep"] and "models/model.onnx" in declared["export"]
    assert "reports/sweep/sweep.json" in declared["sweep"] and "reports/history.csv" in declared["train"]


@pytest.mark.e2e  # DDP and FSDP ranks
@pytest.mark.parametrize("case", list(MATRIX))
def test_every_strategy_and_precision_runs_through_dvc_repro_and_writes_every_declared_output(
    repo_copy: Path, case: str
) -> None:
    params = MATRIX[case]
    set_params(repo_copy, "sweep", **{**SWEEP, **params.get("sweep", {})})
    for section in ("data", "model", "train"):
        if section in params:
            set_params(repo_copy, section, **params[section])
    (repo_copy / "dvc.lock").unlink()  # the template's lock is the real params': every stage runs
    said = run(["dvc", "repro"], repo_copy)  # exits 0, or fails naming the command's output

    missing = [
        f"{stage}: {path}"
        for stage, paths in declared_outputs(repo_copy / "dvc.yaml").items()
        for path in paths
        if not (repo_copy / path).exists()
    ]
    assert not missing, f"declared in dvc.yaml, not written under {case}: {missing}"
    status = run(["dvc", "status"], repo_copy).stdout
    assert "up to date" in status, status

    train = {**yaml.safe_load((repo_copy / "params.yaml").read_text())["train"]}
    summary = (repo_copy / "reports/sweep/summary.md").read_text()
    processes = "one process" if train["strategy"] == "single" else f"{train['nproc']} processes"
    assert f"Trained with train.strategy {train['strategy']} on {processes}" in summary, summary[:400]
    assert f"precision {train['precision']}" in summary.splitlines()[2]
    clock = json.loads((repo_copy / "reports/sweep/throughput.json").read_text())
    # one process is timed side by side; DDP and FSDP read each experiment's own epochs, and say so
    assert clock["source"] == ("table" if train["strategy"] == "single" else "epochs"), clock
    if clock["source"] == "epochs":
        assert [r["batch_size"] for r in clock["rows"]] == SWEEP["batch_sizes"]
        assert "each experiment's own epochs" in summary
    if case == OWN_MODEL:
        _a_users_module_trains_together_predicts_and_an_edit_reruns_what_it_built(repo_copy, said.stdout + said.stderr)
    metrics = json.loads((repo_copy / "reports/metrics.json").read_text())
    classes = json.loads((repo_copy / "data/prepared/dataset.json").read_text())["n_classes"]
    assert metrics["accuracy"] > 1 / classes + 0.1, metrics  # it learned, whatever the strategy and precision


@pytest.mark.integration
@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_a_device_this_machine_lacks_stops_dvc_repro_at_validate_before_any_stage(repo_copy: Path) -> None:
    """train.device cuda here, with bf16 on two ranks: one line naming the key, before generate."""
    set_params(repo_copy, "train", device="cuda", precision="bf16", strategy="ddp", nproc=2)
    proc = run(["dvc", "repro"], repo_copy, check=False)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "batchlab: error: train.device is cuda but torch sees no CUDA device; use cpu or auto" in said, said
    assert "Traceback" not in said and "Running stage 'generate'" not in said
    assert not (repo_copy / "data/prepared").exists()


def _a_users_module_trains_together_predicts_and_an_edit_reruns_what_it_built(repo: Path, said: str) -> None:
    """model.factory's module: its seeds train together (through vmap, seeds/functional.py), the study
    answers, predict takes raw examples, and an edit to the module reruns train and re-measures the
    sweep (dvc.yaml lists usermodels/ as a dependency)."""
    assert "sweep: bs16-seed0, bs16-seed1 train together" in said
    summary = json.loads((repo / "reports/sweep/sweep.json").read_text())
    assert summary["recommended_batch_size"] in (16, 64) and summary["b_simple_exact_at_target"] > 0
    proc = run(["batchlab", "predict", "--model", "models/model.onnx", "--input", "data/prepared/examples.npy"], repo)
    assert len(proc.stdout.splitlines()) == 21
    with (repo / "usermodels/residual.py").open("a") as code:
        code.write("# an edit\n")
    status = run(["dvc", "status", "train"], repo).stdout
    assert "usermodels" in status and "modified" in status, status
    proc = run(["dvc", "repro", "sweep"], repo)  # measured by other code: measured again
    rerun = proc.stdout + proc.stderr
    assert "already finished" not in rerun, [line for line in rerun.splitlines() if "already finished" in line]
    assert "sweep: 7/7 experiments done" in proc.stderr  # 4 fixed, 2 adaptive, the seeds' branches
