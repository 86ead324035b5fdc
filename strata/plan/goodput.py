"""What a real run spends beyond its steady state: checkpoint saves, evaluations and failures, each
a named term in seconds of wall-clock time, so that the expected run is exactly the ideal one
plus them (docs/cost-model.md, "The cost of a run").

  saves       ceil(steps / every) x one save; strata's saves are synchronous: training waits
              while the fullest node writes its share of the checkpoint at the storage bandwidth
  evaluation  strata train's evaluations (at the start, every --eval-every steps, at the end),
              each --eval-batches global batches of forward passes
  failures    interruptions at a rate per device-hour, each costing the restart, reading the
              checkpoint back, and on average half an interval between saves of lost steps

Failures lengthen the run, which brings more failures. With T0 the ideal seconds, S the saves',
E the evaluations', λ the interruptions per second of the whole run and c what each costs:
T = T0 + S + E + λcT, so T = (T0 + S + E) / (1 - λc), and the failures' term is λcT."""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

from strata.config import default_of
from strata.errors import ConfigError
from strata.plan.memory import held_state_bytes, optimizer_rate

# Llama 3 (Dubey et al. 2024, arXiv 2407.21783, section 3.3.4): 466 job interruptions (47 planned,
# 419 unexpected, about 78% of those hardware) in a 54-day snapshot of pre-training on 16,384 H100s
LLAMA3_INTERRUPTIONS, LLAMA3_DEVICES, LLAMA3_DAYS = 466, 16_384, 54
FAILURE_RATE = LLAMA3_INTERRUPTIONS / (LLAMA3_DEVICES * LLAMA3_DAYS * 24)  # 2.19e-5 per device-hour
# Llama 3's checkpoint storage (Tectonic): 2 TB/s sustained over the 2,048 nodes of that run
STORAGE_BANDWIDTH = 1.0  # GB/s per node, written and read
# strata's own 300-s collective timeout (--timeout) to notice a hang, and as long again to replace
# the node, relaunch and meet at the rendezvous (an assumption; reading the checkpoint is apart)
RESTART_MINUTES = 10.0
_TIME = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)([mh])$")


@dataclass(frozen=True)
class GoodputSettings:
    save_every: str | None = None  # steps ('500') or training time ('30m', '2h'); None: Young's interval
    eval_every: int = default_of("eval_every")  # strata train's: 0, at the start and the end only
    eval_batches: int = default_of("eval_batches")  # strata train's: global batches each time
    storage_bandwidth: float = STORAGE_BANDWIDTH
    failure_rate: float = FAILURE_RATE  # interruptions per device-hour
    restart_minutes: float = RESTART_MINUTES

    def check(self) -> GoodputSettings:
        """Itself, once every value is one a run can have (ConfigError naming the first that is not)."""
        checks = (("eval_every", self.eval_every >= 0, "must be >= 0 (0: at the start and the end only)"),
                  ("eval_batches", self.eval_batches >= 1, "must be >= 1"),
                  ("storage_bandwidth", 0 < self.storage_bandwidth < math.inf, "must be a number of GB/s > 0"),
                  ("failure_rate", 0 <= self.failure_rate < math.inf, "must be a number of interruptions per "
                                                                     "device-hour >= 0"),
                  ("restart_minutes", 0 <= self.restart_minutes < math.inf, "must be a number of minutes >= 0"))
        for field, ok, reason in checks:
            if not ok:
                raise ConfigError(reason, field, getattr(self, field))
        if self.save_every is not None:
            save_interval(self.save_every)
        return self


def save_interval(text: str) -> tuple[int | None, float | None]:
    """'500' -> (500 steps, None); '30m' -> (None, 1800 s); '2h' -> (None, 7200 s)."""
    value = text.strip()
    if value.isdigit() and int(value) >= 1:
        return int(value), None
    match = _TIME.match(value)
    if match and float(match[1]) > 0:
        return None, float(match[1]) * {"m": 60, "h": 3600}[match[2]]
    raise ConfigError("give a number of steps >= 1, or a time of training such as 30m or 2h", "save_every", text)


@dataclass(frozen=True)
class Losses:
    """The expected run's time beyond the ideal one, by cause, and how each was counted."""
    steps: int
    step_s: float
    checkpoint_bytes: float  # the weights and optimizer states a checkpoint holds
    save_s: float  # one save (and, as long, one read back after a failure)
    save_every: int  # steps between saves
    young: bool  # save_every is Young's interval (none was given)
    saves: int
    eval_s: float  # one evaluation
    evaluations: int
    failure_rate: float  # interruptions per second of the whole run
    restart_s: float
    lost_s: float  # steps lost to one failure, on average
    checkpoints: float  # seconds, the three named terms
    evaluation: float
    failures: float

    def seconds(self) -> dict[str, float]:
        return {"checkpoints": self.checkpoints, "evaluation": self.evaluation, "failures": self.failures}

    def expected_failures(self, ideal_s: float) -> float:
        return self.failure_rate * (ideal_s + sum(self.seconds().values()))

    def to_json(self) -> dict:
        return {"checkpoint_bytes": self.checkpoint_bytes, "save_s": self.save_s, "save_every_steps": self.save_every,
                "save_every_is_young": self.young, "saves": self.saves, "eval_s": self.eval_s,
                "evaluations": self.evaluations, "failures_per_hour": self.failure_rate * 3600,
                "restart_s": self.restart_s, "lost_s_per_failure": self.lost_s, "steps": self.steps}


def checkpoint_bytes(work) -> float:
    """What strata writes: every parameter (its fp32 master in mixed precision) and the optimizer's
    moments, once each: the planner's own model-state counts, unsharded, without the gradients."""
    states = held_state_bytes(work.model.num_params(), precision="fp32" if work.precision == "fp32" else "mixed",
                              optimizer=optimizer_rate(work.optimizer, work.model))
    return states.weights + states.optimizer


def node_write_bytes(layout, devices_per_node: int, total: float) -> float:
    """What the fullest node writes of a checkpoint of `total` bytes. Under ZeRO-1/2/3 every rank
    writes its shard (total / world each); without ZeRO one replica writes for all (the first:
    dp and cp rank 0; strata/parallel/data.py's `writes`), each of its tp x pp ranks a share, and
    the mesh's rank order (tp innermost, then cp, dp, pp) says which nodes they are on."""
    if layout.zero >= 1:
        return total / layout.world_size * min(devices_per_node, layout.world_size)
    stride = layout.replicas * layout.tp  # ranks between one stage's first rank and the next's
    on_node = Counter((stage * stride + t) // devices_per_node for stage in range(layout.pp) for t in range(layout.tp))
    return total / (layout.tp * layout.pp) * max(on_node.values())


def evaluations(steps: int, every: int) -> int:
    """strata train's: before the first step, after every `every`-th, and after the last."""
    return 1 + (steps // every + (1 if steps % every else 0) if every else 1)


def forward_seconds(work, e) -> float:
    """One global batch, forward only: a third of a training step's model FLOPs (the backward does
    twice the forward's work), at the hardware FLOP/s the training step reaches."""
    model_flops = work.global_batch * work.seq_len * work.model.flops_per_token(work.seq_len)
    return model_flops / 3 / (e.tflops_per_device * 1e12 * e.layout.world_size)


def losses(work, e, tokens: float, devices_per_node: int, settings: GoodputSettings) -> Losses:
    """The three terms for the estimate `e` of `work` training `tokens` (docstring above)."""
    steps = math.ceil(tokens / (work.global_batch * work.seq_len))
    ideal_s, step_s = tokens / e.tokens_per_s, e.step_time_s
    total = checkpoint_bytes(work)
    save_s = node_write_bytes(e.layout, devices_per_node, total) / (settings.storage_bandwidth * 1e9)
    rate = settings.failure_rate * e.layout.world_size / 3600
    every = _save_every(settings.save_every, steps, step_s, save_s, rate)
    eval_s = settings.eval_batches * forward_seconds(work, e)
    count = evaluations(steps, settings.eval_every)
    saves = math.ceil(steps / every)
    restart_s, lost_s = settings.restart_minutes * 60, every * step_s / 2
    per_failure = restart_s + save_s + lost_s
    if rate * per_failure >= 1:
        raise ConfigError(f"the run never finishes: at {settings.failure_rate:.3g} interruptions per device-hour "
                          f"(--failure-rate), {e.layout.world_size:,} devices are interrupted every "
                          f"{1 / rate / 60:.3g} minutes, and each interruption costs {per_failure / 60:.3g} minutes: "
                          f"{restart_s / 60:.3g} to restart (--restart-minutes), {save_s / 60:.3g} to read the "
                          f"checkpoint back (--storage-bandwidth), {lost_s / 60:.3g} of lost steps (--save-every)")
    steady = ideal_s + saves * save_s + count * eval_s
    failures = rate * per_failure * steady / (1 - rate * per_failure)
    if not math.isfinite(steady + failures):
        raise ConfigError(f"a save takes {save_s:.3g} s, an evaluation {eval_s:.3g} s: the run never finishes",
                          "storage_bandwidth", settings.storage_bandwidth)
    return Losses(steps, step_s, total, save_s, every, settings.save_every is None, saves, eval_s, count, rate,
                  restart_s, lost_s, saves * save_s, count * eval_s, failures)


def _save_every(given: str | None, steps: int, step_s: float, save_s: float, rate: float) -> int:
    """Steps between saves: as given (a time of training rounds to whole steps), or Young's
    interval sqrt(2 x save x mean time between interruptions) (Young 1974), which loses least to
    saves and lost work together; with no failures, at the end only. At most the run's steps."""
    if given is not None:
        count, seconds = save_interval(given)
    else:
        count, seconds = None, math.sqrt(2 * save_s / rate) if rate > 0 else math.inf
    if count is None:
        count = seconds / step_s
        if not count < steps:
            return steps
        count = max(1, round(count))
    return min(count, steps)
