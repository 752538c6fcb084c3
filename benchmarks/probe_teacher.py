"""An exploration for issue 63 (a workload where the example budget binds), run by hand, not by
`make bench`: a fixed random teacher labels fresh inputs (each seen once), the built-in MLP's shape
(64x64, ReLU) learns them with AdamW and a cosine lr over examples, and the probe prints, per batch,
lr and seed: the val loss at 5/25/50/75/100% of the budget, its fall over the last 25%, and the
exact noise scale B_simple = tr(Sigma)/|G|^2 at 5% and 50% of the budget (per-example gradients over
M fresh examples, |G|^2 corrected by tr(Sigma)/M: M must be well above B_simple, or |G|^2's own
noise swamps it, and 8,192 was not).

    .venv/bin/python benchmarks/probe_teacher.py \\
        '{"d":128,"width":256,"classes":2,"alpha":2.0,"beta":2.0,"gain":3.0,"temp":0.3,"budget":100000}'

The teacher: inputs z with variance i^-alpha in direction i (the student sees them rotated), one
hidden layer (tanh, or relu with "act": "relu") whose units take direction i's part with variance
~i^-beta, labels sampled from its softmax at temperature `temp` (the Bayes loss is printed).
Figures on this 2-core machine (2026-12-08, beside a CI run), batch 64, lr 0.003, one seed each
unless said; the issue asks for both a fall over the last 25% well over the seed spread (~0.003
here) and a >= 10x rise of B_simple between 5% and 50%:

| teacher | budget | last-25% fall | B_simple 5% -> 50% | rise |
|---|---|---|---|---|
| 10 classes, tanh 256, alpha 2, beta 1.1, temp 1 | 200k | 0.010-0.016 (2 seeds) | 430-480 -> 640-680 | 1.4-1.5x |
| 10 classes, same, temp 0.5 | 200k | 0.013-0.017 (2 seeds) | 200-265 -> 340-620 | 1.7-2.3x |
| 10 classes, relu 32 (realizable), temp 0.5 | 200k | 0.012 | 274 -> 706 | 2.6x |
| 10 classes, tanh 256, temp 0.5 | 50k | 0.014 | 388 -> 488 | 1.3x |
| 2 classes, tanh 256, beta 2, gain 3, temp 0.3 | 100k | 0.0005 | 114 -> 1467 | 12.8x |
| d 32, 2 classes, tanh 64, beta 2, temp 0.3 (3 seeds) | 6.4k | 0.0025-0.0041 | 40-46 -> 186-500 | 4.0-10.9x |
| d 32, 2 classes, tanh 64, beta 1.5, temp 0.3 (3 seeds) | 12.8k | 0.0012-0.0031 | 36-52 -> 512-1069 | 13-30x |
| d 32, same (3 seeds) | 51.2k | 0.0020-0.0053 | 165-445 -> 409-2506 | 1.0-15x |
| d 48, 2 classes, tanh 96, beta 1.3, temp 0.3 (3 seeds) | 25.6k | 0.0014-0.0034 | 82-367 -> 1979-4565 | 6.9-26x |
| d 64, 2 classes, tanh 128, beta 1.5, temp 0.3 (3 seeds) | 25.6k | 0.0026-0.0051 | 349-423 -> 354-2190 | 1.0-5.8x |

Ten classes keep the loss falling but B_simple is high from the first steps (label noise
dominates Sigma at once); two classes with a steep teacher on few dimensions give the rise, with a
last-25% fall about the size of the final loss's seed spread (~0.003), not well over it. And one
iterate's exact B_simple scatters 1-15x between seeds of one configuration (where SGD's noise put
the weights): the issue's 10x check will need the readings of several seeds or iterates, not one.
Nothing is asserted.
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from batchlab.training.gns_exact import exact_noise_scale

Teacher = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, str]


def teacher(cfg: dict[str, Any], seed: int = 7) -> Teacher:
    d, width, classes = cfg["d"], cfg["width"], cfg["classes"]
    rng = np.random.default_rng(seed)
    scale = np.arange(1, d + 1) ** (-cfg["alpha"] / 2)  # the inputs' std per direction
    rotation = np.linalg.qr(rng.standard_normal((d, d)))[0]
    part = np.arange(1, d + 1) ** (-cfg.get("beta", 1.0) / 2)  # std of direction i's part of a unit's input
    w1 = rng.standard_normal((d, width)) * (part / scale)[:, None] / np.sqrt((part**2).sum()) * cfg.get("gain", 3.0)
    w2 = rng.standard_normal((width, classes)) / np.sqrt(width) * 3.0
    return scale, rotation, w1, w2, cfg.get("act", "tanh")


def draw(t: Teacher, n: int, temp: float, seed: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """n fresh examples (rotated inputs, sampled labels) and the Bayes loss on them."""
    scale, rotation, w1, w2, act = t
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, len(scale))) * scale
    hidden = np.tanh(z @ w1) if act == "tanh" else np.maximum(z @ w1, 0)
    logits = hidden @ w2 / temp
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    y = (p.cumsum(1) > rng.random((n, 1))).argmax(1)
    bayes = float(-np.log(p[np.arange(n), y]).mean())
    return torch.from_numpy((z @ rotation.T).astype(np.float32)), torch.from_numpy(y), bayes


def b_simple(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """tr(Σ)/|G|² of the distribution the rows are drawn from: batchlab's exact noise scale over
    the rows (their own population), its |G|² less the tr(Σ)/M that M rows' mean adds to it."""
    exact = exact_noise_scale(model, nn.functional.cross_entropy, x, y)
    return exact.trace / (exact.grad_sq - exact.trace / exact.rows)


def run(cfg: dict[str, Any], t: Teacher, batch: int, lr: float, seed: int) -> tuple[dict[float, float], list[float]]:
    torch.manual_seed(seed)
    x, y, _ = draw(t, cfg["budget"], cfg["temp"], 1000 + seed)
    x_val, y_val, _ = draw(t, 20000, cfg["temp"], 99)
    x_noise, y_noise, _ = draw(t, cfg.get("M", 32768), cfg["temp"], 98)
    model = nn.Sequential(nn.Linear(x.shape[1], 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, cfg["classes"]))  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    steps = cfg["budget"] // batch
    cosine = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    evaluations = {int(steps * k / 20): k / 20 for k in range(1, 21)}
    val: dict[float, float] = {}
    noise: list[float] = []
    for step in range(1, steps + 1):
        rows = slice((step - 1) * batch, step * batch)
        loss = nn.functional.cross_entropy(model(x[rows]), y[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        cosine.step()
        if step in evaluations:
            with torch.no_grad():
                val[evaluations[step]] = float(nn.functional.cross_entropy(model(x_val), y_val))
        if step in (int(steps * 0.05), int(steps * 0.5)):
            noise.append(b_simple(model, x_noise, y_noise))
    return val, noise


def main() -> None:
    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    t = teacher(cfg)
    print("Bayes loss", round(draw(t, 20000, cfg["temp"], 99)[2], 4), flush=True)
    for batch in cfg.get("batches", [64]):
        for lr in cfg.get("lrs", [0.003]):
            for seed in range(cfg.get("seeds", 1)):
                started = time.time()
                val, (early, late) = run(cfg, t, batch, lr, seed)
                at = " ".join(f"{int(k * 100)}%={val[k]:.4f}" for k in (0.05, 0.25, 0.5, 0.75, 1.0))
                print(f"batch {batch} lr {lr} seed {seed}: val {at}, last-25% fall {val[0.75] - val[1.0]:.4f}, "
                      f"B_simple {early:.0f} -> {late:.0f} ({late / early:.1f}x), {time.time() - started:.0f} s",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
