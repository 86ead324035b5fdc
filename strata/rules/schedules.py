"""Pipeline schedules as data: a pure function of (stages p, micro-batches m, virtual stages v)
returning, for each rank, the ordered list of compute actions it runs. One executor runs any of
them; communication follows from the actions (a forward of chunk k > 0 receives from chunk k-1,
a backward of chunk k < last receives from chunk k+1), so a schedule is checked here, without
processes, by simulating it.

  F  forward of one micro-batch through one chunk of layers
  B  backward: the whole backward, or (zero-bubble) only the input gradient
  W  weight gradient (zero-bubble schedules split it from B)

Chunk c (of p·v) lives on rank c % p; with v = 1 chunk c is stage c on rank c.

Sources: GPipe (Huang et al. 2019); 1F1B / PipeDream-Flush and interleaved 1F1B (Narayanan et al.
2021); ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Action:
    kind: Literal["F", "B", "W"]
    microbatch: int
    chunk: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}c{self.chunk}"


Schedule = list[list[Action]]  # per rank


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


# `strata schedule` simulates at most this many actions (F, B, W): a few seconds of Python.
MAX_SIMULATED_ACTIONS = 100_000


@dataclass(frozen=True)
class ScheduleSpec:
    """What the runtime, the planner and the CLI know of a schedule: how to build it and the two
    properties that change how it runs."""
    build: Callable[[int, int, int], Schedule]  # (p, m, v) -> actions per rank
    splits_backward: bool  # B computes input gradients only and W the weight gradients (zero-bubble)
    virtual_stages: bool  # several chunks per rank: needs v >= 2 (and only it accepts v > 1)
    source: str


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(lambda p, m, v: gpipe(p, m), False, False, "Huang et al. 2019"),
    "1f1b": ScheduleSpec(lambda p, m, v: one_f_one_b(p, m), False, False, "Narayanan et al. 2021 (PipeDream-Flush)"),
    "interleaved": ScheduleSpec(interleaved_one_f_one_b, False, True, "Narayanan et al. 2021"),
    "zb": ScheduleSpec(lambda p, m, v: zero_bubble_h1(p, m), True, False, "Qi et al. 2024 (ZB-H1)"),
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


def simulate(schedule: Schedule, num_chunks: int, cost: dict[str, float]) -> Simulation:
    """Run the schedule with the given cost per action kind (per chunk) and zero-cost messages.
    Each rank runs its actions in order, an action starting when its inputs exist: F(c) after
    F(c-1) of the same micro-batch, B(c) after B(c+1) (the last chunk after its own F), W(c) after
    B(c). Raises Deadlock (a RuntimeError) if no rank can proceed."""
    start_at: dict[Action, float] = {}
    finish: dict[Action, float] = {}
    clock = [0.0] * len(schedule)
    position = [0] * len(schedule)
    busy = [0.0] * len(schedule)
    split_backward = any(a.kind == "W" for actions in schedule for a in actions)
    while any(position[r] < len(schedule[r]) for r in range(len(schedule))):
        progressed = False
        for r, actions in enumerate(schedule):
            while position[r] < len(actions):
                action = actions[position[r]]
                deps = _dependencies(action, num_chunks)
                if any(d not in finish for d in deps):
                    break
                start = max([clock[r], *(finish[d] for d in deps)])
                duration = cost[action.kind] if split_backward or action.kind != "B" else cost["B"] + cost.get("W", 0)
                start_at[action] = start
                finish[action] = clock[r] = start + duration
                busy[r] += duration
                position[r] += 1
                progressed = True
        if not progressed:
            raise Deadlock({r: schedule[r][position[r]] for r in range(len(schedule)) if position[r] < len(schedule[r])})
    return Simulation(start_at, finish, busy, max(clock))


def _stuck_ranks(schedule: Schedule, num_chunks: int) -> list[int]:
    try:
        simulate(schedule, num_chunks, {"F": 1.0, "B": 1.0, "W": 1.0})
        return []
    except Deadlock as e:
        return sorted(e.stuck)


class Deadlock(RuntimeError):
    def __init__(self, stuck: dict[int, Action]):
        super().__init__(f"deadlock: ranks waiting at {stuck}")
        self.stuck = stuck


def _dependencies(action: Action, num_chunks: int) -> list[Action]:
    i, c = action.microbatch, action.chunk
    if action.kind == "F":
        return [Action("F", i, c - 1)] if c > 0 else []
    if action.kind == "B":
        return [Action("F", i, c)] + ([Action("B", i, c + 1)] if c < num_chunks - 1 else [])
    return [Action("B", i, c)]


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
