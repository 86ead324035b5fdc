"""What a training run costs: wall-clock days, device-hours and price for a number of tokens at a
layout's predicted throughput, and the smallest cluster that trains them in a given number of days.

  days = tokens / (tokens/s) / 86,400      device-hours = days x 24 x devices
  price = device-hours x price per device-hour

(The field's rule of thumb, training FLOPs ≈ 6ΨT over peak x MFU, is the same arithmetic: the
planner's tokens/s already is peak x efficiency over the FLOPs per token, with the communication,
bubble and optimizer time of the layout added.)

That is the ideal run, steady state only. The expected run adds checkpoint saves, evaluations and
failures (strata/plan/goodput.py), each a named term: expected seconds = ideal seconds + their sum."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from strata.errors import ConfigError
from strata.plan.goodput import GoodputSettings, Losses, losses
from strata.plan.hardware import Device
from strata.plan.workload import Estimate, Workload
from strata.rules.limits import CEILINGS

SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
MAX_NODES = CEILINGS["nodes"].value  # where the search for a cluster that finishes in time gives up
STALLED = 2  # doublings of the nodes without a faster run, after which that search gives up


@dataclass(frozen=True)
class RunCost:
    train_days: float
    device_hours: float
    price: float | None  # None without a price per device-hour

    def to_json(self) -> dict:
        return {"train_days": self.train_days, "device_hours": self.device_hours, "price": self.price}


def parse_count(text: str, flag: str) -> float:
    """'2T' -> 2e12 ('300B', '1.5e12', '10M', '800K'): a positive number of tokens."""
    value, scale = text.strip(), 1.0
    if value[-1:].upper() in SUFFIXES:
        value, scale = value[:-1], SUFFIXES[value[-1].upper()]
    try:
        count = float(value) * scale
    except ValueError:
        count = math.nan
    if not (math.isfinite(count) and count > 0):
        raise ConfigError(f"{flag} {text}: give a positive number, optionally with K, M, B (or G) or T, e.g. 2T")
    return count


def run_cost(e: Estimate, tokens: float, price_per_device_hour: float | None = None) -> RunCost:
    return _cost(tokens / e.tokens_per_s, e.layout.world_size, price_per_device_hour)


def _cost(seconds: float, devices: int, price_per_device_hour: float | None) -> RunCost:
    device_hours = seconds / 3600 * devices
    price = device_hours * price_per_device_hour if price_per_device_hour is not None else None
    return RunCost(seconds / 86400, device_hours, price)


@dataclass(frozen=True)
class RunCosts:
    """A layout's run, ideal and expected, and the named overheads between them (seconds)."""
    ideal: RunCost
    expected: RunCost
    losses: Losses

    @property
    def goodput(self) -> float:
        """The share of the expected run's time that trains: ideal over expected."""
        return self.ideal.train_days / self.expected.train_days

    def to_json(self) -> dict:
        """The ideal's keys at the top, as before there was an expected run, and both by name."""
        return {**self.ideal.to_json(), "ideal": self.ideal.to_json(), "expected": self.expected.to_json(),
                "overheads": self.losses.seconds(), "goodput": {"ratio": self.goodput, **self.losses.to_json()}}


def expected_cost(work: Workload, e: Estimate, tokens: float, devices_per_node: int, settings: GoodputSettings,
                  price_per_device_hour: float | None = None) -> RunCosts:
    """The ideal run and the expected one: the ideal seconds plus each named overhead's."""
    ideal_s = tokens / e.tokens_per_s
    lost = losses(work, e, tokens, devices_per_node, settings)
    expected_s = ideal_s + sum(lost.seconds().values())
    world = e.layout.world_size
    return RunCosts(_cost(ideal_s, world, price_per_device_hour), _cost(expected_s, world, price_per_device_hour), lost)


def fastest_days(work: Workload, device: Device, devices: int, tokens: float) -> float:
    """A floor under every layout's days: the training FLOPs of `tokens` (6 per weight and token,
    and attention's) on `devices` devices computing at their highest peak, nothing else."""
    return tokens * work.model.flops_per_token(work.seq_len) / (devices * max(device.peak_flops.values())) / 86400


def smallest_cluster(best_at: Callable[[int], Estimate | None], tokens: float, days: float) -> tuple[int, Estimate]:
    """The fewest nodes whose best layout trains `tokens` within `days`: doubling until one does,
    then bisecting between the last that did not and the first that did. best_at(nodes) gives the
    best runnable layout on that many nodes (None: nothing fits or runs). The doubling gives up
    at MAX_NODES, or once STALLED doublings in a row did not shorten the fastest run found: past
    what the global batch lets devices share, more nodes only add communication, and searching
    on to MAX_NODES would take minutes to say so."""
    fastest: tuple[float, int] | None = None  # (days, nodes) of the fastest run found while doubling
    stalled = 0

    def finishes(nodes: int) -> Estimate | None:
        nonlocal fastest, stalled
        e = best_at(nodes)
        if e is None:
            return None
        took = run_cost(e, tokens).train_days
        if fastest is not None:
            stalled = stalled + 1 if took >= fastest[0] else 0
        fastest = min(fastest or (took, nodes), (took, nodes))
        return e if took <= days else None

    low, high = 0, 1  # low: known not to finish (0: none tried)
    found = finishes(high)
    while found is None:
        low, high = high, 2 * high
        if high > MAX_NODES or stalled >= STALLED:
            reason = f"not even {MAX_NODES} nodes train {tokens:.3g} tokens in time" if high > MAX_NODES else \
                f"the fastest run found takes {fastest[0]:.3g} days (on {fastest[1]} nodes), and {STALLED} " \
                f"doublings of the nodes after it were no faster"
            raise ConfigError(f"--days {days:g}: {reason} (with this global batch; a larger --global-batch lets more "
                              f"devices help)")
        found = finishes(high)
    while high - low > 1:
        middle = (low + high) // 2
        e = finishes(middle)
        if e is not None:
            high, found = middle, e
        else:
            low = middle
    return high, found
