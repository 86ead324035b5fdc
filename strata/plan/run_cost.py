"""What a training run costs: wall-clock days, device-hours and price for a number of tokens at a
layout's predicted throughput, and the smallest cluster that trains them in a given number of days.

  days = tokens / (tokens/s) / 86,400      device-hours = days x 24 x devices
  price = device-hours x price per device-hour

(The field's rule of thumb, training FLOPs ≈ 6ΨT over peak x MFU, is the same arithmetic: the
planner's tokens/s already is peak x efficiency over the FLOPs per token, with the communication,
bubble and optimizer time of the layout added.)"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from strata.errors import ConfigError
from strata.plan.cost import Estimate

SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
MAX_NODES = 1 << 16  # where the search for a cluster that finishes in time gives up


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
    seconds = tokens / e.tokens_per_s
    device_hours = seconds / 3600 * e.layout.world_size
    price = device_hours * price_per_device_hour if price_per_device_hour is not None else None
    return RunCost(seconds / 86400, device_hours, price)


def smallest_cluster(best_at: Callable[[int], Estimate | None], tokens: float, days: float) -> tuple[int, Estimate]:
    """The fewest nodes whose best layout trains `tokens` within `days`: doubling until one does,
    then bisecting between the last that did not and the first that did. best_at(nodes) gives the
    best runnable layout on that many nodes (None: nothing fits or runs)."""
    def finishes(nodes: int) -> Estimate | None:
        e = best_at(nodes)
        return e if e is not None and run_cost(e, tokens).train_days <= days else None

    low, high = 0, 1  # low: known not to finish (0: none tried)
    found = finishes(high)
    while found is None:
        low, high = high, 2 * high
        if high > MAX_NODES:
            raise ConfigError(f"--days {days:g}: not even {MAX_NODES} nodes train {tokens:.3g} tokens in time "
                              f"(with this global batch; a larger --global-batch lets more devices help)")
        found = finishes(high)
    while high - low > 1:
        middle = (low + high) // 2
        e = finishes(middle)
        if e is not None:
            high, found = middle, e
        else:
            low = middle
    return high, found
