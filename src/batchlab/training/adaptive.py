"""train.adaptive_batch: the global batch grows by integer factors as the measured noise scale
rises, and the learning rate follows.

McCandlish et al. (2018, "An Empirical Model of Large-Batch Training", eq. 2.11): to reach a given
loss, a run at batch B takes S = S_min(1 + B_noise/B) steps and E = E_min(1 + B/B_noise) examples.
Every train.adapt_every_examples examples seen (an epoch by default: so a large batch is not stuck
for epochs between decisions) the run reads its B_noise, the in-training B_simple (gns.py) with its
standard error, and chooses by train.adapt_rule:

- `time` (the default): the batch whose steps reach the loss soonest, S(B)·t(B) with the step time
  t(B) = a + b·B (train.adapt_step_time: the throughput table's fit, training/throughput.py). Its
  unconstrained minimum is B* = √(a·B_noise/b); the rule takes the best of the batches it can move
  to (the current one times 2^k, up to the cap).
- `statistical`: weighing a step against an example equally, S/S_min + E/E_min = 2 + B_noise/B +
  B/B_noise, least at B = B_noise; it doubles while that saves.
- `schedule`: no reading; from each share of the run's examples in train.adapt_schedule on, the
  largest batch it can reach up to that share's (Merrill et al. 2025's batch warmup; the sweep's
  measured local CBS(t) writes one: study/local_cbs.schedule).

The first two grow only when the time (or cost) saved exceeds train.adapt_threshold at the reading's
lower 95% bound (b·exp(-1.645·se/b), one-sided, on the log scale the reading's error has): a
reading whose interval does not clear the threshold holds the batch. It never shrinks: the noise
scale rises over training, and a shrink on one low reading would undo a grow. Every decision is a
function of the recorded step time and the run's own readings: an interrupted run, a DDP run and a
rerun take the same schedule.
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
from batchlab.training.gns_estimates import FullSplitMeasure, pooled
from batchlab.training.optim import scaled_lr
from batchlab.training.strategy import Strategy

log = logging.getLogger(__name__)

GROWTH = 2  # the batch moves by powers of this integer factor
Z_ONE_SIDED = 1.644854  # the reading's lower 95% bound
# the time rule spaces its decisions so that their probes cost at most this share of the steps'
# time between them (a probe on the default problem: 16.5 ms, 35 steps at batch 256)
PROBE_SHARE = 0.2
# a decision's reading: measurements at the decision's weights, pooled, until its standard error
# is within this fraction of it or MAX_PROBES were taken (one reads ±25-35% late in a default run)
TARGET_REL_SE = 0.15
MAX_PROBES = 4


def cost(batch: float, b_noise: float) -> float:
    """Steps and examples to a given loss at `batch`, each relative to its minimum, summed."""
    return 2.0 + b_noise / batch + batch / b_noise


def gain_of_growing(batch: int, b_noise: float) -> float:
    """The cost a batch of GROWTH x `batch` saves, as a fraction of the cost at `batch`."""
    return (cost(batch, b_noise) - cost(GROWTH * batch, b_noise)) / cost(batch, b_noise)


def seconds_to_loss(batch: float, b_noise: float, step_time: tuple[float, ...]) -> float:
    """S(B)·t(B) / S_min: the seconds to a given loss at `batch`, in units of S_min."""
    a, b = step_time[:2]
    return (1 + b_noise / batch) * (a + b * batch)


def time_optimum(b_noise: float, step_time: tuple[float, ...]) -> float:
    """The batch that minimises S(B)·t(B): √(a·B_noise/b) (∞ with no per-row cost)."""
    a, b = step_time[:2]
    return math.sqrt(a * b_noise / b) if b > 0 else math.inf


def lower_bound(b_noise: float, se: float) -> float:
    """The reading's one-sided lower 95% bound (the reading itself where it has no standard error)."""
    if not math.isfinite(se) or b_noise <= 0:
        return b_noise
    return b_noise * math.exp(-Z_ONE_SIDED * se / b_noise)


@dataclass
class BatchSchedule:
    """The batch of each step and the decisions that changed it (kept in the checkpoint)."""

    batch: int
    cap: int  # train.max_batch_size, at most the train split
    every: int  # train.adapt_every_examples: examples between decisions
    threshold: float  # train.adapt_threshold
    divisor: int  # world size x grad_accum_steps: every batch divides by it
    lr_rule: str  # train.adapt_lr_scaling
    rule: str = "statistical"  # train.adapt_rule
    step_time: tuple[float, ...] | None = None  # the time rule's (a, b) and a probe's seconds p
    decisions: list[dict[str, Any]] = field(default_factory=list)
    start: int = 0  # the first step's batch (train.batch_size)
    next_step: int = 0  # the step after which the next decision falls
    plan: tuple[tuple[float, int], ...] = ()  # the schedule rule's (share of `total`, batch)
    total: int = 0  # the run's examples: the starting batch's epochs

    def __post_init__(self) -> None:
        self.start = self.start or self.batch
        self.next_step = self.next_step or self.period()

    @classmethod
    def from_config(cls, tc: TrainConfig, n_train: int) -> BatchSchedule | None:
        if not tc.adaptive_batch:
            return None
        cap = min(tc.max_batch_size or n_train, n_train)
        divisor = tc.world_size() * tc.grad_accum_steps
        step_time = tuple(tc.adapt_step_time) if tc.adapt_step_time is not None else None
        plan = tuple((float(s), int(b)) for s, b in tc.adapt_schedule or [])
        return cls(tc.batch_size, cap, tc.adapt_every_examples or n_train, tc.adapt_threshold, divisor,
                   tc.adapt_lr_scaling, tc.adapt_rule, step_time, plan=plan, total=tc.epochs * n_train)

    def period(self) -> int:
        """Steps between decisions at the current batch: train.adapt_every_examples of its rows; under
        the time rule at least as many as keep the probe before each within PROBE_SHARE of the steps'
        time (the decisions a probe costs more than they can save are not taken)."""
        steps = math.ceil(self.every / self.batch)
        if self.rule == "time" and self.step_time is not None and len(self.step_time) > 2:
            a, b, probe = self.step_time[:3]
            steps = max(steps, math.ceil(probe / (PROBE_SHARE * (a + b * self.batch))))
        return max(1, steps)

    def due(self, step: int) -> bool:
        """A decision after this step, until the batch is at its cap."""
        return step >= self.next_step and not self.at_cap()

    def at_cap(self) -> bool:
        return self._larger() == []

    def _larger(self) -> list[int]:
        """The batches it can grow to: the current one times GROWTH^k, up to the cap, dividing by
        world size x grad_accum_steps."""
        out, b = [], GROWTH * self.batch
        while b <= self.cap:
            if b % self.divisor == 0:
                out.append(b)
            b *= GROWTH
        return out

    def choose(self, b_noise: float) -> tuple[int, float]:
        """The batch the rule moves to at the reading `b_noise`, and the fraction it saves there."""
        if self.rule == "time":
            assert self.step_time is not None
            now = seconds_to_loss(self.batch, b_noise, self.step_time)
            best = min([self.batch, *self._larger()], key=lambda b: seconds_to_loss(b, b_noise, self.step_time))  # type: ignore[arg-type]
            return best, 1 - seconds_to_loss(best, b_noise, self.step_time) / now
        larger = self._larger()
        if not larger or larger[0] != GROWTH * self.batch:
            return self.batch, 0.0
        return larger[0], gain_of_growing(self.batch, b_noise)

    def scheduled(self, examples: int) -> tuple[int, str]:
        """The schedule rule's batch after `examples`: the largest it can reach up to the plan's there."""
        share = examples / self.total if self.total else 0.0
        target = max([b for s, b in self.plan if s <= share + 1e-6], default=self.batch)  # shares kept to 6 places
        to = max([b for b in self._larger() if b <= target], default=self.batch)  # never below the batch now
        return to, f"{'grow' if to > self.batch else 'hold'}: train.adapt_schedule's batch at {share:.0%} of " \
                   f"the run's examples is {target}"

    def decide(self, step: int, examples: int, b_noise: float, se: float = math.nan) -> float | None:
        """The decision after `step` optimizer steps (`examples` seen) on the reading `b_noise` (its
        standard error `se`; none under the schedule rule): the factor that rescales the learning
        rate when the batch grows, else None."""
        low, gain, to, optimum = lower_bound(b_noise, se), math.nan, self.batch, None
        if self.rule == "schedule":
            to, reason = self.scheduled(examples)
        elif not math.isfinite(b_noise) or b_noise <= 0:
            reason = "no noise-scale reading yet"
        elif not self._larger():
            reason = f"hold: {GROWTH * self.batch} is above the cap {self.cap} or does not divide by {self.divisor}"
        else:
            if self.step_time is not None:
                optimum = time_optimum(b_noise, self.step_time)
            target, gain = self.choose(low)
            if target == self.batch or gain <= self.threshold:
                reason = f"hold: growing saves {max(gain, 0):.1%} at the lower bound {low:.0f} (threshold " \
                         f"{self.threshold:.0%})"
            else:
                to = target
                what = "of the time to a loss" if self.rule == "time" else "of steps + examples"
                reason = f"grow: saves {gain:.1%} {what} at the lower bound {low:.0f}"
        self.decisions.append(
            {"step": step, "examples": examples, "b_noise": b_noise, "b_noise_se": se, "b_noise_low": low,
             "optimum": optimum, "from": self.batch, "to": to, "gain": gain, "reason": reason}
        )
        factor = scaled_lr(1.0, self.batch, to, self.lr_rule) if to != self.batch else None
        self.batch = to
        self.next_step = step + self.period()
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
        return {"batch": self.batch, "next_step": self.next_step, "decisions": [dict(d) for d in self.decisions]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.batch, self.decisions = int(state["batch"]), [dict(d) for d in state["decisions"]]
            self.next_step = int(state.get("next_step", self.period()))


@dataclass
class Adapting:
    """The schedule in the loop: what a decision reads (the noise scale), what it changes (the
    batch, the learning rate, the probe's windows) and where a change is recorded."""

    batches: BatchSchedule
    noise: NoiseScale
    tracker: Tracker
    strategy: Strategy

    @property
    def is_main(self) -> bool:
        return self.strategy.is_main

    @classmethod
    def start(
        cls, batches: BatchSchedule, noise: NoiseScale, tracker: Tracker, strategy: Strategy, state: TrainState,
        trainee: Trainee,
    ) -> Adapting:
        """The schedule where the checkpoint left it (its lr is the optimizer's own state). Each
        decision reads the noise scale at its own weights (`reading`); between decisions the probe
        keeps to its cost model (train.gns_every, if set, wins), for the run's gns.* figures."""
        if batches.rule == "schedule" and not batches.plan:
            raise ConfigError("train.adapt_rule schedule needs train.adapt_schedule: [[share of the run's "
                              "examples, batch], ...] (a sweep with sweep.local_cbs writes one)")
        if batches.rule != "schedule" and (not noise.enabled or strategy.probe is None):  # said why above
            raise ConfigError("train.adaptive_batch reads the noise scale, which is not measured for this model "
                              "(the line above says why): set train.adaptive_batch: false")
        if batches.rule == "time" and batches.step_time is None:
            raise ConfigError("train.adapt_rule time needs train.adapt_step_time: `batchlab train` times it when "
                              "it starts; set [a, b] or train.adapt_rule: statistical")
        batches.load_state_dict(state.batch_schedule)
        adapting = cls(batches, noise, tracker, strategy)
        if not state.steps and batches.rule != "statistical":  # the starting batch: the rule's at the start
            adapting.decide(0, 0, trainee)
        if adapting.is_main and not state.steps:
            tracker.log_epoch(adapting.figures(trainee), step=0)
        return adapting

    def reading(self, step: int) -> tuple[float, float]:
        """B_noise and its standard error at the current weights: measurements pooled until the
        standard error is within TARGET_REL_SE of the reading or MAX_PROBES were taken, each counted
        (the study's clock charges them), their rows drawn by `step` (a resumed run draws the same).
        Where the rows' own gradients cannot be taken, the latest scheduled reading, without one."""
        probe = self.strategy.probe
        assert probe is not None
        measures: list[FullSplitMeasure] = []
        while len(measures) < MAX_PROBES:
            measures.append(probe.measure(step, draw=len(measures)))
            self.noise.probes += 1
            if measures[-1].row_sq is None:
                return self.noise.b_simple, self.noise.se
            found = pooled(measures, self.noise.population)
            if math.isfinite(found.se) and found.se <= TARGET_REL_SE * found.b_simple:
                break
        return found.b_simple, found.se

    def figures(self, trainee: Trainee) -> dict[str, float]:
        lr = float(trainee.optimizer.param_groups[0]["lr"])
        return {"adaptive.batch_size": float(self.batches.batch), "adaptive.lr": lr}

    def decide(self, step: int, examples: int, trainee: Trainee) -> int:
        """The decision after `step` steps: the next steps' batch. On a change the learning rate is
        rescaled, and the noise scale's open windows start over (their steps' norms were another
        batch's)."""
        before = self.batches.batch
        reading = self.reading(step) if self.batches.rule != "schedule" else (math.nan, math.nan)
        factor = self.batches.decide(step, examples, *reading)
        if factor is not None:
            trainee.schedule.rescale(factor, self.batches.batch)
            self.noise.restart_windows()
            if self.is_main:
                log.info("adaptive batch: %d -> %d at step %d (%s)", before, self.batches.batch, step,
                         self.batches.decisions[-1]["reason"])
                if step:
                    self.tracker.log_epoch(self.figures(trainee), step=step)
        return self.batches.batch
