"""train.adaptive_batch: the global batch doubles when the measured noise scale says a step of
twice the rows costs less, and the learning rate follows.

The rule (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", eq. 2.11): to
reach a given loss, a run at batch B takes S = S_min(1 + B_noise/B) steps and E = E_min(1 +
B/B_noise) examples. Weighing a step's time against an example's equally, the cost
S/S_min + E/E_min = 2 + B_noise/B + B/B_noise is least at B = B_noise, the critical batch where
both are twice their minimum. Every train.adapt_every_steps the run reads its B_noise (the
in-training B_simple, gns.py) and doubles B when that cuts the cost by more than
train.adapt_threshold (with the default 5%: when B_noise > ~1.65 B), so B follows B_noise up
within a factor of ~1.65, as the noise scale rises while the loss falls. It never shrinks: the
noise scale rises over training, and a shrink on one low reading would undo a grow.

Why not Pollux's goodput (throughput x statistical efficiency): it needs the throughput at a batch
the run has not run yet, and reads the clock, so two runs of the same config would choose
different batches: no exact resume, no reproduce. This rule reads only what the steps computed,
so an interrupted run, a DDP run and a rerun take the same schedule. The cost it balances is
statistical; on hardware where a step's fixed cost dominates, a larger batch than B_noise may be
faster in seconds: the study's adaptive row measures what it gives.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from batchlab.config import ConfigError, TrainConfig
from batchlab.tracking import Tracker
from batchlab.training.checkpoint import Trainee, TrainState
from batchlab.training.gns import NoiseScale
from batchlab.training.optim import scaled_lr
from batchlab.training.strategy import Strategy

log = logging.getLogger(__name__)

GROWTH = 2  # a change multiplies the batch by this integer factor


def cost(batch: float, b_noise: float) -> float:
    """Steps and examples to a given loss at `batch`, each relative to its minimum, summed."""
    return 2.0 + b_noise / batch + batch / b_noise


def gain_of_growing(batch: int, b_noise: float) -> float:
    """The cost a batch of GROWTH x `batch` saves, as a fraction of the cost at `batch`."""
    return (cost(batch, b_noise) - cost(GROWTH * batch, b_noise)) / cost(batch, b_noise)


@dataclass
class BatchSchedule:
    """The batch of each step and the decisions that changed it (kept in the checkpoint)."""

    batch: int
    cap: int  # train.max_batch_size, at most the train split
    every: int  # train.adapt_every_steps
    threshold: float  # train.adapt_threshold
    divisor: int  # world size x grad_accum_steps: every batch divides by it
    lr_rule: str  # train.adapt_lr_scaling
    decisions: list[dict[str, Any]] = field(default_factory=list)
    start: int = 0  # the first step's batch (train.batch_size)

    def __post_init__(self) -> None:
        self.start = self.start or self.batch

    @classmethod
    def from_config(cls, tc: TrainConfig, n_train: int) -> BatchSchedule | None:
        if not tc.adaptive_batch:
            return None
        cap = min(tc.max_batch_size or n_train, n_train)
        divisor = tc.world_size() * tc.grad_accum_steps
        return cls(tc.batch_size, cap, tc.adapt_every_steps, tc.adapt_threshold, divisor, tc.adapt_lr_scaling)

    def due(self, step: int) -> bool:
        """A decision after this step: every `every` steps, until the batch is at its cap."""
        return step % self.every == 0 and not self.at_cap()

    def at_cap(self) -> bool:
        return GROWTH * self.batch > self.cap

    def decide(self, step: int, examples: int, b_noise: float) -> float | None:
        """The decision after `step` optimizer steps (`examples` seen) on the reading `b_noise`:
        the factor that rescales the learning rate when the batch grows, else None."""
        new, gain = GROWTH * self.batch, math.nan
        if not math.isfinite(b_noise) or b_noise <= 0:
            reason = "no noise-scale reading yet"
        else:
            gain = gain_of_growing(self.batch, b_noise)
            if gain <= self.threshold:
                reason = f"hold: growing saves {gain:.1%} (threshold {self.threshold:.0%})"
            elif new > self.cap:
                reason = f"hold: {new} is above the cap {self.cap}"
            elif new % self.divisor:
                reason = f"skipped: {new} does not divide by world size x grad_accum_steps ({self.divisor})"
            else:
                reason = f"grow: saves {gain:.1%} of steps + examples"
        to = new if reason.startswith("grow") else self.batch
        self.decisions.append(
            {"step": step, "examples": examples, "b_noise": b_noise, "from": self.batch, "to": to,
             "gain": gain, "reason": reason}
        )  # fmt: skip
        if to == self.batch:
            return None
        factor = scaled_lr(1.0, self.batch, to, self.lr_rule)
        self.batch = to
        return factor

    def examples_at(self, step: int) -> int:
        """Examples seen once `step` optimizer steps were done."""
        at_step, examples, batch = 0, 0, self.start
        for change in self.changes():
            if change["step"] >= step:
                break
            at_step, examples, batch = change["step"], change["examples"], change["to"]
        return examples + (step - at_step) * batch

    def changes(self) -> list[dict[str, Any]]:
        return [d for d in self.decisions if d["to"] != d["from"]]

    def summary(self) -> str:
        """The schedule in one line: start batch, then each change's step."""
        parts = [str(self.start)]
        parts += [f"{d['to']} (step {d['step']})" for d in self.changes()]
        return " -> ".join(parts)

    def state_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "decisions": [dict(d) for d in self.decisions]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.batch, self.decisions = int(state["batch"]), [dict(d) for d in state["decisions"]]


@dataclass
class Adapting:
    """The schedule in the loop: what a decision reads (the noise scale), what it changes (the
    batch, the learning rate, the probe's windows) and where a change is recorded."""

    batches: BatchSchedule
    noise: NoiseScale
    tracker: Tracker
    strategy: Strategy
    paced: bool = True  # the probe's period is the schedule's (train.gns_every unset)

    @property
    def is_main(self) -> bool:
        return self.strategy.is_main

    @classmethod
    def start(
        cls, batches: BatchSchedule, noise: NoiseScale, tracker: Tracker, strategy: Strategy, state: TrainState,
        trainee: Trainee,
    ) -> Adapting:  # fmt: skip
        """The schedule where the checkpoint left it (its lr is the optimizer's own state). The
        noise probe measures once before each decision (train.gns_every, if set, wins), until the
        batch reaches its cap: from there nothing is left to decide and the probe keeps to its cost."""
        if not noise.enabled or strategy.probe is None:  # no noise probe for this model (said why above)
            raise ConfigError("train.adaptive_batch reads the noise scale, which is not measured for this model "
                              "(the line above says why): set train.adaptive_batch: false")  # fmt: skip
        batches.load_state_dict(state.batch_schedule)
        adapting = cls(batches, noise, tracker, strategy, paced=strategy.probe.every is None)
        adapting._pace_the_probe()
        if adapting.is_main and not state.steps:
            tracker.log_epoch(adapting.figures(trainee), step=0)
        return adapting

    def _pace_the_probe(self) -> None:
        probe = self.strategy.probe
        if not self.paced or probe is None:
            return
        if self.batches.at_cap():
            probe.follow_cost_model()
        else:
            probe.once_before_each(self.batches.every)

    def figures(self, trainee: Trainee) -> dict[str, float]:
        lr = float(trainee.optimizer.param_groups[0]["lr"])
        return {"adaptive.batch_size": float(self.batches.batch), "adaptive.lr": lr}

    def decide(self, step: int, examples: int, trainee: Trainee) -> int:
        """The decision after `step` steps: the next steps' batch. On a change the learning rate is
        rescaled, and the noise scale's open windows start over (their steps' norms were another
        batch's)."""
        before = self.batches.batch
        factor = self.batches.decide(step, examples, self.noise.b_simple)
        if factor is not None:
            trainee.schedule.rescale(factor, self.batches.batch)
            self.noise.restart_windows()
            self._pace_the_probe()
            if self.is_main:
                log.info("adaptive batch: %d -> %d at step %d (%s)", before, self.batches.batch, step,
                         self.batches.decisions[-1]["reason"])  # fmt: skip
                self.tracker.log_epoch(self.figures(trainee), step=step)
        return self.batches.batch
