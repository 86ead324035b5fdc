"""Pipeline schedules as data: a pure function of (stages p, micro-batches m, virtual stages v)
returning, for each rank, the ordered list of compute actions it runs. One executor runs any of
them; communication follows from the actions (a forward of chunk k > 0 receives from chunk k-1,
a backward of chunk k < last receives from chunk k+1), so a schedule is checked here, without
processes, by simulating it.

  F  forward of one micro-batch through one chunk of layers
  B  backward: the whole backward, or (zero-bubble) only the input gradient
  W  weight gradient (zero-bubble schedules split it from B)

Chunk c (of p·v) lives on rank c % p; with v = 1 chunk c is stage c on rank c.

The asynchronous schedules (PipeDream-2BW and PipeDream) never flush: their pipeline is one 1F1B
over the run's whole stream of micro-batches, numbered across steps (micro-batch k belongs to step
k // m), and a step's part of it on a rank is a `segment`: its backwards of the step's micro-batches
and the forwards that run between them, some of which belong to the next step. What they change is
which weights a micro-batch sees: `ScheduleSpec.delay` (below) is the rule, and the runtime keeps
the weight versions it needs (strata/parallel/pipeline/versions.py).

Sources: GPipe (Huang et al. 2019); 1F1B / PipeDream-Flush and interleaved 1F1B (Narayanan et al.
2021); ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024); PipeDream (Narayanan et al.
2019); PipeDream-2BW (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", 2021)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal


@dataclass(frozen=True)
class Action:
    kind: Literal["F", "B", "W"]
    microbatch: int
    chunk: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}c{self.chunk}"


Schedule = list[list[Action]]  # per rank


@dataclass(frozen=True)
class Message:
    """What passes between two stages: an activation (forward, to the next chunk) or a gradient
    (backward, to the chunk before), for one micro-batch, from stage `sender` to stage `receiver`."""
    kind: Literal["activation", "gradient"]
    sender: int
    receiver: int
    microbatch: int
    chunk: int  # the chunk that receives it


def messages(action: Action, p: int, num_chunks: int) -> tuple[Message | None, Message | None]:
    """What an action receives before it runs and what it sends once it has run, each None where
    there is none: F(i, c) receives chunk c-1's activation (c > 0) and sends its own to c+1
    (c < last); B(i, c) receives chunk c+1's gradient (c < last) and sends one to c-1 (c > 0); W
    neither. Chunk c lives on stage c % p. The executor posts these, and the tests replay them
    under NCCL's ordering rules for every schedule."""
    i, c, last = action.microbatch, action.chunk, num_chunks - 1
    if action.kind == "F":
        return (Message("activation", (c - 1) % p, c % p, i, c) if c > 0 else None,
                Message("activation", c % p, (c + 1) % p, i, c + 1) if c < last else None)
    if action.kind == "B":
        return (Message("gradient", (c + 1) % p, c % p, i, c) if c < last else None,
                Message("gradient", c % p, (c - 1) % p, i, c - 1) if c > 0 else None)
    return None, None


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards: m micro-batches of activations in flight on every stage."""
    return [[Action("F", i, r) for i in range(m)] + [Action("B", i, r) for i in range(m)] for r in range(p)]


def one_f_one_b(p: int, m: int) -> Schedule:
    """Warm-up of p-r-1 forwards, then one forward / one backward, then the remaining backwards:
    at most p micro-batches in flight on the first stage."""
    schedule = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        actions = [Action("F", i, r) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [Action("F", warmup + i, r), Action("B", i, r)]
        actions += [Action("B", i, r) for i in range(m - warmup, m)]
        schedule.append(actions)
    return schedule


def interleaved_one_f_one_b(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B: rank r holds chunks r, r+p, ..., r+(v-1)p; micro-batches go
    through a rank's chunks in groups of p, so the bubble shrinks to (p-1)/(v·m) of ideal. When p
    does not divide m the last group is smaller (and the bubble a little larger)."""
    groups = [range(start, min(start + p, m)) for start in range(0, m, p)]

    def order(backward: bool) -> list[tuple[int, int]]:
        """The forwards (or backwards) of one rank in order: (micro-batch, which of its v chunks)."""
        return [(i, (v - 1 - local) if backward else local)
                for group in groups for local in range(v) for i in group]

    forwards, backwards = order(False), order(True)
    total = m * v

    def rank_actions(r: int, warmup: int) -> list[Action]:
        f = [Action("F", i, local * p + r) for i, local in forwards]
        b = [Action("B", i, local * p + r) for i, local in backwards]
        actions = f[:warmup]
        for k in range(total - warmup):
            actions += [f[warmup + k], b[k]]
        return actions + b[total - warmup:]

    # Megatron's warm-up; with a short last group a rank can reach a backward whose input is not
    # made yet, so the warm-up of a rank the dependency check finds stuck grows by one until none is.
    warmups = [min((p - r - 1) * 2 + (v - 1) * min(p, m), total) for r in range(p)]
    while True:
        schedule = [rank_actions(r, warmups[r]) for r in range(p)]
        stuck = _stuck_ranks(schedule, p * v)
        if not stuck:
            return schedule
        for r in stuck:
            warmups[r] = min(warmups[r] + 1, total)


def zero_bubble_h1(p: int, m: int) -> Schedule:
    """ZB-H1: 1F1B with the backward split into input gradient (B) and weight gradient (W). B is
    on the critical path and runs where 1F1B runs the whole backward; W is deferred to fill idle
    time. Rank r may hold up to r deferred W's: 1F1B keeps p-r micro-batches in flight on rank r,
    so every rank then holds p, the first stage's 1F1B peak (H1: "the same memory as 1F1B"). The
    bubble falls from (p-1)(F+B+W) to (p-1)(F+B-W): a third, with equal costs."""
    schedule = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        actions = [Action("F", i, r) for i in range(warmup)]
        pending: list[int] = []
        for i in range(m):
            if warmup + i < m:
                actions.append(Action("F", warmup + i, r))
            actions.append(Action("B", i, r))
            pending.append(i)
            if len(pending) > r:
                actions.append(Action("W", pending.pop(0), r))
        actions += [Action("W", i, r) for i in pending]
        schedule.append(actions)
    return schedule


def segment(p: int, m: int, rank: int, step: int, fill: bool, stop: int) -> list[Action]:
    """Rank `rank`'s actions in step `step` of a flushless 1F1B over the micro-batch stream (global
    numbers k = step·m + j): a backward of each of the step's micro-batches, each after the forward
    of the micro-batch p-rank-1 places later, which may belong to the next step (or a later one,
    when m < p). fill: the pipeline is empty (the run's first step, or after a pause), so the
    warm-up forwards come first; stop: the first micro-batch not to start (the stream pauses there
    for an evaluation, a checkpoint or the end); the step drains the pipeline when it is the next
    step's first. With fill and a drain it is one step of 1F1B, and the segments between a fill and
    a drain concatenate to one 1F1B over all their micro-batches."""
    ahead, first, end = p - rank - 1, step * m, (step + 1) * m
    actions = [Action("F", k, rank) for k in range(first, min(first + ahead, stop))] if fill else []
    for k in range(first, end):
        if k + ahead < stop:
            actions.append(Action("F", k + ahead, rank))
        actions.append(Action("B", k, rank))
    return actions


def flushless(p: int, m: int, steps: int) -> Schedule:
    """`steps` consecutive segments on every rank, filled at the start and drained at the end."""
    return [[a for t in range(steps) for a in segment(p, m, r, t, t == 0, steps * m)] for r in range(p)]


# `strata schedule` simulates at most this many actions (F, B, W): a few seconds of Python.
MAX_SIMULATED_ACTIONS = 100_000


@dataclass(frozen=True)
class ScheduleSpec:
    """What the runtime, the planner and the CLI know of a schedule: how to build it and the
    properties that change how it runs."""
    build: Callable[[int, int, int], Schedule]  # (p, m, v) -> actions per rank (async: one step, filled and drained)
    splits_backward: bool  # B computes input gradients only and W the weight gradients (zero-bubble)
    virtual_stages: bool  # several chunks per rank: needs v >= 2 (and only it accepts v > 1)
    source: str
    # Asynchronous schedules: (p, stage) -> how many updates older than the newest are the weights a
    # step's micro-batches use on that stage (forward and backward alike: weight stashing). None:
    # synchronous, every micro-batch of step t sees the weights after t updates.
    delay: Callable[[int, int], int] | None = None
    update_per_micro_batch: bool = False  # PipeDream: a step is one micro-batch per data-parallel rank

    @property
    def asynchronous(self) -> bool:
        return self.delay is not None

    def tied_apart(self, p: int) -> int:
        """Updates between the versions the first and the last of p stages compute with: a tied
        embedding, which both hold, must see one version, so it needs 0."""
        return self.delay(p, 0) - self.delay(p, p - 1) if self.asynchronous else 0

    def versions(self, p: int, stage: int) -> int:
        """Weight versions stage `stage` stashes at its peak: the one each in-flight step computes
        with, and the newest (that the next micro-batch to start will use)."""
        return self.delay(p, stage) + 1 if self.asynchronous else 1


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(lambda p, m, v: gpipe(p, m), False, False, "Huang et al. 2019"),
    "1f1b": ScheduleSpec(lambda p, m, v: one_f_one_b(p, m), False, False, "Narayanan et al. 2021 (PipeDream-Flush)"),
    "interleaved": ScheduleSpec(interleaved_one_f_one_b, False, True, "Narayanan et al. 2021"),
    "zb": ScheduleSpec(lambda p, m, v: zero_bubble_h1(p, m), True, False, "Qi et al. 2024 (ZB-H1)"),
    # W(t+1) = W(t) - lr·grad f(W(t-1)) on every stage whatever p: the update that ends step t is
    # applied to the newest weights while step t+1's first micro-batches already run on them.
    "2bw": ScheduleSpec(lambda p, m, v: one_f_one_b(p, m), False, False, "Narayanan et al. 2021 (PipeDream-2BW)",
                        delay=lambda p, stage: 1),
    # An update after every micro-batch; the forward of micro-batch k on stage i follows the
    # backward of k-(p-i) there, so it sees p-i-1 fewer updates than the newest.
    "pipedream": ScheduleSpec(lambda p, m, v: one_f_one_b(p, m), False, False, "Narayanan et al. 2019 (PipeDream)",
                              delay=lambda p, stage: p - stage - 1, update_per_micro_batch=True),
    # PipeDream's vertical sync: a micro-batch uses on every stage the version the first stage gave
    # it when it entered the pipeline, p-1 updates old.
    "pipedream-vs": ScheduleSpec(lambda p, m, v: one_f_one_b(p, m), False, False,
                                 "Narayanan et al. 2019 (PipeDream, vertical sync)",
                                 delay=lambda p, stage: p - 1, update_per_micro_batch=True),
}


def build(name: str, p: int, m: int, v: int = 1) -> Schedule:
    return SCHEDULES[name].build(p, m, v)


# --- checking a schedule without processes ---------------------------------------------------------
@dataclass
class Simulation:
    start: dict[Action, float]  # when each action began
    finish: dict[Action, float]  # when each action ended
    busy: list[float]  # compute time per rank
    makespan: float

    def idle_fraction(self, rank: int) -> float:
        return 1 - self.busy[rank] / self.makespan


def simulate(schedule: Schedule, num_chunks: int, cost: dict[str, float], times: bool = True) -> Simulation:
    """Run the schedule with the given cost per action kind (per chunk) and zero-cost messages.
    Each rank runs its actions in order, an action starting when its inputs exist: F(c) after
    F(c-1) of the same micro-batch, B(c) after B(c+1) (the last chunk after its own F), W(c) after
    B(c). Raises Deadlock (a RuntimeError) if no rank can proceed. times=False leaves out each
    action's start and finish (what the planner's thousands of calls do not read).

    Each action is visited once: a rank runs until an input is missing, then waits on it, and the
    action that produces it wakes the rank (the times do not depend on the order ranks are run).
    Actions are numbered (kind, micro-batch, chunk) -> one int, so that finish times sit in a list
    and an input is found by arithmetic on its number: the planner simulates schedules of tens of
    thousands of actions."""
    if any(not 0 <= a.chunk < num_chunks or a.microbatch < 0 for actions in schedule for a in actions):
        raise ValueError(f"a schedule of {num_chunks} chunks: every action's chunk in 0..{num_chunks - 1}, "
                         f"its micro-batch 0 or more")
    microbatches = 1 + max((a.microbatch for actions in schedule for a in actions), default=0)
    per_kind = microbatches * num_chunks  # numbers of one kind: micro-batch * num_chunks + chunk
    numbers = [[_KIND_INDEX[a.kind] * per_kind + a.microbatch * num_chunks + a.chunk for a in actions]
               for actions in schedule]
    finish: list[float | None] = [None] * (len(_KINDS) * per_kind)
    start_at: dict[int, float] = {}
    clock = [0.0] * len(schedule)
    position = [0] * len(schedule)
    busy = [0.0] * len(schedule)
    split_backward = any(a.kind == "W" for actions in schedule for a in actions)
    duration = {kind: cost[kind] if split_backward or kind != "B" else cost["B"] + cost.get("W", 0)
                for kind in ("F", "B", "W") if kind in cost}
    seconds = [duration.get(kind) for kind in _KINDS]  # by kind index (None: not in the costs)
    forward_kind, backward_kind = _KIND_INDEX["F"], _KIND_INDEX["B"]
    backward, weight = backward_kind * per_kind, _KIND_INDEX["W"] * per_kind  # the first number of each
    last = num_chunks - 1
    waiting: dict[int, list[int]] = {}  # an action not run yet -> the ranks blocked on it
    runnable = list(range(len(schedule)))
    while runnable:
        r = runnable.pop()
        ranks_numbers, pos, clock_r = numbers[r], position[r], clock[r]
        while pos < len(ranks_numbers):
            number = ranks_numbers[pos]
            kind, c = number // per_kind, number % num_chunks
            # its inputs, as the docstring says, by number: this loop is the planner's hot path.
            # F(i, c) needs F(i, c-1); B(i, c) F(i, c) and B(i, c+1); W(i, c) B(i, c)
            if kind == forward_kind:
                first, second = (number - 1 if c > 0 else None), None
            elif kind == backward_kind:
                first, second = number - backward, (number + 1 if c < last else None)
            else:
                first, second = number - (weight - backward), None
            ready = True
            for dep in (first, second):
                if dep is not None:
                    done = finish[dep]
                    if done is None:
                        waiting.setdefault(dep, []).append(r)
                        ready = False
                        break
                    if done > clock_r:
                        clock_r = done
            if not ready:
                break
            if times:
                start_at[number] = clock_r
            took = seconds[kind]
            if took is None:  # a kind the costs leave out
                raise KeyError(_KINDS[kind])
            clock_r += took
            finish[number] = clock_r
            busy[r] += took
            pos += 1
            woken = waiting.pop(number, None)
            if woken:
                runnable.extend(woken)
        position[r], clock[r] = pos, clock_r
    if any(position[r] < len(schedule[r]) for r in range(len(schedule))):
        raise Deadlock({r: schedule[r][position[r]] for r in range(len(schedule)) if position[r] < len(schedule[r])})
    if not times:
        return Simulation({}, {}, busy, max(clock))
    by_action = {a: n for actions, ranks_numbers in zip(schedule, numbers) for a, n in zip(actions, ranks_numbers)}
    return Simulation({a: start_at[n] for a, n in by_action.items()}, {a: finish[n] for a, n in by_action.items()},
                      busy, max(clock))


_KINDS = ("F", "B", "W")  # simulate's numbering of the actions' kinds
_KIND_INDEX = {kind: index for index, kind in enumerate(_KINDS)}


def _stuck_ranks(schedule: Schedule, num_chunks: int) -> list[int]:
    try:
        simulate(schedule, num_chunks, {"F": 1.0, "B": 1.0, "W": 1.0}, times=False)
        return []
    except Deadlock as e:
        return sorted(e.stuck)


class Deadlock(RuntimeError):
    def __init__(self, stuck: dict[int, Action]):
        super().__init__(f"deadlock: ranks waiting at {stuck}")
        self.stuck = stuck


def unit_costs(name: str, v: int) -> dict[str, float]:
    """Per-action costs of a stage's work split into v chunks: F 1, B 2 (or B 1 + W 1 where the
    schedule splits the backward), each chunk doing 1/v of it. What the planner and `strata
    schedule` simulate with (a backward costs about twice a forward)."""
    if SCHEDULES[name].splits_backward:
        return {"F": 1 / v, "B": 1 / v, "W": 1 / v}
    return {"F": 1 / v, "B": 2 / v}  # (a "W" here would be added to B: `simulate` runs a whole backward as B + W)


@dataclass(frozen=True)
class Profile:
    """What a schedule costs, simulated with unit costs: the idle time of a step beyond its work,
    in micro-batch slots (one micro-batch's forward and backward on a stage), and per rank the
    micro-batches whose activations it holds at its peak, in whole-stage units (a chunk holds 1/v
    of the rank's layers)."""
    bubble_slots: float
    in_flight: tuple[float, ...]


# Past a few rounds of p micro-batches a schedule repeats itself: its bubble and its peak counts
# are affine in m from there on (tests/test_pipeline_schedules.py checks it against the full
# simulation), so a long step is simulated at two sizes of the same remainder mod p and the rest
# extrapolated. The planner asks about hundreds of (p, m) pairs; this keeps each to milliseconds.
EXACT_UP_TO_ROUNDS = 3


@lru_cache(maxsize=4096)
def profile(name: str, p: int, m: int, v: int = 1) -> Profile:
    """The planner's bubble and activation counts for p stages, m micro-batches and v chunks per
    rank, from the schedule itself rather than a formula per name."""
    if m <= EXACT_UP_TO_ROUNDS * p:
        return _simulated_profile(name, p, m, v)
    m1 = (EXACT_UP_TO_ROUNDS - 1) * p + m % p
    a, b = _simulated_profile(name, p, m1, v), _simulated_profile(name, p, m1 + p, v)
    rounds = (m - m1) / p
    return Profile(a.bubble_slots + rounds * (b.bubble_slots - a.bubble_slots),
                   tuple(x + rounds * (y - x) for x, y in zip(a.in_flight, b.in_flight)))


@lru_cache(maxsize=4096)  # profile's extrapolation asks for the same two sizes for every m of a remainder
def _simulated_profile(name: str, p: int, m: int, v: int) -> Profile:
    if SCHEDULES[name].asynchronous:
        return _steady_profile(p, m)
    schedule = build(name, p, m, v)
    costs = unit_costs(name, v)
    sim = simulate(schedule, p * v, costs, times=False)
    per_micro_batch = v * sum(costs.values())
    return Profile((sim.makespan - max(sim.busy)) / per_micro_batch,
                   tuple(peak_in_flight(actions) / v for actions in schedule))


# Steps simulated to see a flushless schedule's steady state: the fill is in the first, the drain in
# the last, and the one added between two runs of it costs exactly its steady-state time.
STEADY_STEPS = 3


def _steady_profile(p: int, m: int) -> Profile:
    """A flushless schedule's cost per step in steady state: what one more step between the fill and
    the drain adds to the makespan, beyond its work (zero with equal stages: nothing waits), and its
    peak activations (those of 1F1B: p - rank micro-batches on rank `rank`, whatever m)."""
    costs = unit_costs("1f1b", 1)
    short, long = (flushless(p, m, steps) for steps in (STEADY_STEPS, STEADY_STEPS + 1))
    added = simulate(long, p, costs, times=False).makespan - simulate(short, p, costs, times=False).makespan
    per_micro_batch = costs["F"] + costs["B"]
    return Profile(max(added - m * per_micro_batch, 0.0) / per_micro_batch,
                   tuple(float(peak_in_flight(actions)) for actions in long))


def peak_in_flight(actions: list[Action]) -> int:
    """The most micro-batches whose forward has run and whose backward has not finished (the
    weight gradient, when split off, still needs the activations), on one rank: the schedule's
    activation memory, in micro-batch chunks."""
    releases = "W" if any(a.kind == "W" for a in actions) else "B"
    live, peak = 0, 0
    for a in actions:
        live += 1 if a.kind == "F" else -1 if a.kind == releases else 0
        peak = max(peak, live)
    return peak
