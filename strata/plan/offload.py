"""The planner's price of the offload tiers: what host memory and disk hold per device, and how long
their transfers take (strata/rules/offload.py counts the bytes, as the runtime moves them).

Each tier's transfers run on one worker thread beside compute, reads and writes one after another,
so a tier is busy read/read-rate + written/write-rate. The forward and backward's transfers (the
parameter shards read ahead a unit at a time, the gradients written behind) hide behind compute
up to its length, all but the first unit's read, which nothing precedes; the optimizer step is a
pass over the tiers, as long as the longer of its arithmetic and its transfers.

The host tier moves at the device's host link (PCIe; on a CPU device it is a copy in memory); the
disk at its read and write rates. Offloaded files the machine's free memory can hold are read
back from the page cache, at its rate, as this machine's measurements show (cpu-local: `strata
calibrate` measures the disk both ways; for GPU nodes the host memory is not known and the disk's
own rate is used)."""

from __future__ import annotations

from dataclasses import dataclass

from strata.errors import ConfigError
from strata.plan.hardware import Device
from strata.rules.layout import Layout
from strata.rules.offload import (
    MASTER_BYTES,
    MOMENT_BYTES,
    Traffic,
    activation_traffic,
    moment_traffic,
    parameter_traffic,
)

TIER_NAMES = {"cpu": "host", "disk": "disk"}


@dataclass(frozen=True)
class OffloadCost:
    tier_bytes: dict[str, float]  # what the host memory and the disk hold for one device
    during_compute_s: float  # the forward and backward's transfers (hidden up to the compute)
    first_read_s: float  # the first unit's read, before any compute
    optimizer_s: float  # the optimizer step's transfers

    @property
    def total_s(self) -> float:
        return self.during_compute_s + self.optimizer_s


def offloads(lay: Layout) -> bool:
    return any(value != "none" for value in (lay.offload, lay.offload_params, lay.offload_activations))


def offload_cost(device: Device, lay: Layout, params_local: float, largest_unit: float, activation_bytes: float,
                 micro_batches: int, kept_unit: float = 0.0, page_cache_bytes: float = 0.0) -> OffloadCost:
    """params_local: the parameters this rank's tensor-parallel slice holds; largest_unit: the most
    parameters one ZeRO-3 unit has (of that slice); activation_bytes: one micro-batch's checkpointed
    block inputs; kept_unit: a unit kept gathered from forward to backward (a tied embedding);
    page_cache_bytes: memory left for the page cache (0: reads come from the disk)."""
    sharded = params_local / (lay.shards if lay.zero >= 1 else 1)  # what this rank's optimizer updates
    during, step, held = {}, {}, {}

    def add(where: str, compute: Traffic, optimizer: Traffic, stored: float) -> None:
        tier = TIER_NAMES[where]
        during[tier] = during.get(tier, Traffic()) + compute
        step[tier] = step.get(tier, Traffic()) + optimizer
        held[tier] = held.get(tier, 0.0) + stored

    if lay.offload_params != "none":
        backward, update = parameter_traffic(sharded, micro_batches, kept_unit / (lay.shards if lay.zero >= 1 else 1))
        add(lay.offload_params, backward, update, 2 * MASTER_BYTES * sharded)  # fp32 shards and their gradients
    if lay.offload == "disk":
        add("disk", Traffic(), moment_traffic(sharded), MOMENT_BYTES * sharded)
    elif lay.offload == "cpu":  # priced with the optimizer step (cost.py): only what the host holds here
        held["host"] = held.get("host", 0.0) + MOMENT_BYTES * sharded
    if lay.offload_activations != "none":  # to host memory; a CPU device's host is itself: a file
        where = "disk" if device.name == "cpu-local" else "cpu"
        add(where, activation_traffic(activation_bytes, micro_batches), Traffic(), activation_bytes)
    rates = {tier: _rates(device, tier, held.get(tier, 0.0), page_cache_bytes) for tier in set(during) | set(step)}

    def seconds(traffic: dict[str, Traffic]) -> float:
        return sum(t.read / rates[tier][0] + t.written / rates[tier][1] for tier, t in traffic.items())

    first = 0.0
    if lay.offload_params != "none":
        read_rate = rates[TIER_NAMES[lay.offload_params]][0]
        first = MASTER_BYTES * largest_unit / (lay.shards if lay.zero >= 1 else 1) / read_rate
    return OffloadCost(held, seconds(during), first, seconds(step))


def _rates(device: Device, tier: str, held: float, page_cache_bytes: float) -> tuple[float, float]:
    """(read, write) bytes/s of a tier for this device."""
    if tier == "host":
        return device.host_bandwidth, device.host_bandwidth
    if not device.disk_read or not device.disk_write:
        raise ConfigError(f"--device {device.name}: its disk is not measured; run `strata calibrate` again "
                          f"(it measures the disk now) to price offloading to disk")
    cached = min(1.0, page_cache_bytes / held) if held else 0.0
    cached_rate = device.disk_cached_read or device.disk_read
    # a read takes the cached share at the page cache's rate and the rest at the disk's
    return 1 / (cached / cached_rate + (1 - cached) / device.disk_read), device.disk_write
