"""The peak memory of this process: CUDA's allocations on a GPU, the resident set (RSS) on the CPU."""

from __future__ import annotations

import contextlib
import resource
from pathlib import Path

import torch


def reset(device: torch.device) -> None:
    """Start a fresh peak: a sweep runs experiments one after another in one process."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # Linux: resets VmHWM to the current RSS


def peak_mb(device: torch.device) -> float:
    """Peak CUDA allocation, or the process's peak resident memory (RSS) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("VmHWM:")).split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
