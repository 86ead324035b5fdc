"""What the planner is asked about, from the user's words: a model (a preset, a strata checkpoint,
or a Hugging Face config.json), a cluster (device, nodes, links) and the training settings."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import replace

import numpy

from strata.errors import ConfigError
from strata.files import cache_dir, read_json_object
from strata.model.config import ModelConfig
from strata.plan.cost import BYTES, Cluster, Workload
from strata.plan.hardware import DEVICES, GB, LINKS, Device, Kernels, power_clock_factor
from strata.plan.links import core_split
from strata.rules.constants import BUCKET_MB
from strata.rules.layout import check_workload
from strata.rules.limits import check_ceiling
from strata.rules.optimizers import check_optimizer

CPU_LOCAL = "cpu-local"
# What TCP/IP delivers of an Ethernet link's line rate with a 1500-byte MTU: 1448 payload bytes per
# 1538 on the wire (headers, preamble, gap), the transport gloo and NCCL's socket backend use.
# InfiniBand's rates (RDMA) are data rates already.
TCP_GOODPUT = 1448 / 1538


def bandwidth(value: str, flag: str, device: Device | None = None) -> float:
    """'nvlink' (the device's), a link name, or a number of GB/s -> bytes/s per direction."""
    if value == "nvlink":
        if device is None or device.nvlink_bandwidth is None:
            raise ConfigError(f"{flag} nvlink: the {device.name if device else 'device'} has no NVLink; "
                              f"use pcie or a number of GB/s")
        return device.nvlink_bandwidth
    if value in LINKS:
        return LINKS[value]
    try:
        gbps = float(value)
    except ValueError:
        raise ConfigError(f"{flag} {value}: valid: {', '.join(['nvlink', *LINKS])} or GB/s as a number") from None
    if not 0 < gbps < float("inf"):
        raise ConfigError(f"{flag} {value}: must be a number of GB/s > 0")
    return gbps * GB


def check_efficiency(efficiency: float | None) -> None:
    """--efficiency, training and serving plans alike (None: the device's default)."""
    if efficiency is not None and not 0 < efficiency <= 1:
        raise ConfigError(f"--efficiency {efficiency}: must be in (0, 1]")


def build_cluster(device: str, nodes: int, per_node: int, intra: str | None, network: str,
                  nics_per_node: int = 1, profile: str | None = None, efficiency: float | None = None,
                  power_cap: float | None = None) -> Cluster:
    for flag, value in (("--nodes", nodes), ("--gpus-per-node", per_node), ("--nics-per-node", nics_per_node)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: must be >= 1")
        check_ceiling(flag[2:].replace("-", "_"), value)
    check_efficiency(efficiency)
    if device == CPU_LOCAL:
        if power_cap is not None:
            raise ConfigError(f"--power-cap {power_cap:g}: a GPU's; cpu-local is measured as it runs")
        return cpu_local_cluster(per_node, load_profile(profile), efficiency)
    if device not in DEVICES:
        raise ConfigError(f"--device {device}: valid: {', '.join([*DEVICES, CPU_LOCAL])}")
    dev = capped(DEVICES[device], power_cap)
    # NVLink inside a node where it joins the node's devices (H100 NVL's bridges join pairs only)
    intra = intra or ("nvlink" if dev.nvlink_bandwidth and per_node <= dev.nvlink_domain else "pcie")
    goodput = 1.0 if network.startswith("ib-") else TCP_GOODPUT
    cluster = Cluster(dev, nodes, per_node, bandwidth(intra, "--intra", dev),
                      bandwidth(network, "--network") * nics_per_node * goodput)
    if efficiency is not None:
        cluster = Cluster(**{**cluster.__dict__, "efficiency": efficiency})
    return cluster


def capped(device: Device, power_cap: float | None) -> Device:
    """The device under a power limit of `power_cap` watts (None: its default, the highest): its
    compute clock slowed by hardware.power_clock_factor. A cap outside the range the device's
    driver accepts is refused, as is one on a device whose range the table does not know."""
    if power_cap is None:
        return device
    if device.power_range_w is None:
        known = ", ".join(name for name, d in DEVICES.items() if d.power_range_w)
        raise ConfigError(f"--power-cap {power_cap:g}: the table has no power range for the {device.name}; "
                          f"valid with: {known}")
    low, high = device.power_range_w
    if not low <= power_cap <= high:
        raise ConfigError(f"--power-cap {power_cap:g}: the {device.name} takes {low:g} to {high:g} W")
    # below the clock it holds at its highest limit (a GH100's sustained clock: hardware.py)
    kernels = replace(device.kernels, clock_factor=device.kernels.clock_factor * power_clock_factor(device, power_cap))
    return replace(device, kernels=kernels)


def check_fp8(device: Device, precision: str) -> None:
    """--fp8 where it can be priced: a 16-bit run (Transformer Engine's recipe) on a device with FP8."""
    if precision not in ("bf16", "fp16"):
        raise ConfigError(f"--fp8: FP8 matmuls in a bf16 or fp16 run (Transformer Engine's recipe); "
                          f"--precision is {precision}")
    if device.fp8_flops is None or device.kernels.fp8_gemm_fraction is None:
        with_fp8 = ", ".join(name for name, d in DEVICES.items() if d.fp8_flops)
        raise ConfigError(f"--fp8: the {device.name} has no FP8 matrix units; valid devices: {with_fp8}")


# --- cpu-local: the calibration profile --------------------------------------------------------
def default_profile_path() -> str:
    return os.path.join(cache_dir(), "calibration.json")


def load_profile(path: str | None) -> dict:
    path = path or default_profile_path()
    if not os.path.isfile(path):
        raise ConfigError(f"--device {CPU_LOCAL}: no calibration profile at {path}; run `strata calibrate` first")
    return read_json_object(path, "a calibration profile: run `strata calibrate` again")


def cpu_local_cluster(processes: int, profile: dict, efficiency: float | None = None) -> Cluster:
    """This machine as `processes` devices of one node, from what `strata calibrate` measured with
    that many processes running at once (core_share: the nearest measured count). Each process gets the share
    of one process's speed that a training step's forward and backward kept while all of them ran
    it, for its GEMMs and its memory-bound kernels alike, and for the fixed cost of each kernel
    (the dispatch and the Python around it are time on the core too)."""
    if "kernels" not in profile or "step_seconds_per_process" not in profile:
        raise ConfigError("--device cpu-local: the calibration profile predates the kernel measurements; "
                          "run `strata calibrate` again")
    share = core_share(processes, profile)
    disk = profile.get("disk", {})  # absent in profiles from before the disk was measured
    kernels = Kernels(**profile["kernels"])
    kernels = replace(kernels, gemm_overhead_s=kernels.gemm_overhead_s / share,
                      kernel_overhead_s=kernels.kernel_overhead_s / share)
    device = Device(CPU_LOCAL, int(profile["memory_bytes"] / processes), {"fp32": profile["matmul_flops"]["1"] * share},
                    profile["memory_bandwidth"] * share, None, kernels,
                    host_bandwidth=profile["memory_bandwidth"] * share, disk_read=disk.get("read_bytes_per_s"),
                    disk_write=disk.get("write_bytes_per_s"), disk_cached_read=disk.get("cached_read_bytes_per_s"),
                    # the host is the device: host memory adds nothing; the disk's free space, shared
                    host_memory_bytes=None, disk_bytes=_free_disk(disk) / processes,
                    # processes, not a GPU: no CUDA context, NCCL buffers or caching allocator
                    context_bytes=0.0, group_bytes=0.0, allocator_reserve=0.0)
    # what a tensor-parallel collective costs inside a step beyond the loop's time (calibrate's
    # collective_in_step); not a pipeline's sends, whose waits the schedule's bubble prices
    in_step = in_step_seconds(profile)
    collectives = {op: {key: collective_points(by_size, key, profile["cores"], in_step if op != "send" else None)
                        for key in by_size}
                   for op, by_size in profile["collectives"].items()}
    together = {op: {key: monotone([point[:2] for point in m["points"]]) for key, m in by_size.items()}
                for op, by_size in profile["collectives"].items()}
    return Cluster(device, 1, processes, profile["memory_bandwidth"], 0.0, 0.0, 0.0, efficiency, collectives,
                   together, overlap=False, shared_cores=profile["cores"])


def core_share(processes: int, profile: dict) -> float:
    """The share of one process's speed each of `processes` gets on the calibrated cores: the
    cores split among them (all of one each while there are enough), times how much of that the
    nearest measured count kept (its step against one process's, over its own even split). Three
    processes on two cores get 2/3 of what two kept, not all of it."""
    steps, cores = profile["step_seconds_per_process"], profile["cores"]
    nearest = min((int(n) for n in steps), key=lambda n: (abs(n - processes), n))
    kept = steps["1"] / steps[str(nearest)] / core_split(nearest, cores)
    return core_split(processes, cores) * kept


def in_step_seconds(profile: dict) -> Callable[[float], float]:
    """What a tensor-parallel collective of n bytes costs inside a step beyond its loop time, from
    calibration's points (`collective_in_step_points`): linear between the measured sizes, the
    nearest one's beyond them. Profiles of one number for every size (`collective_in_step_s`,
    before the points) keep it; those before either, and those without 2 processes, add nothing."""
    points = sorted(profile.get("collective_in_step_points") or [[1.0, profile.get("collective_in_step_s", 0.0)]])
    sizes, seconds = [p[0] for p in points], [p[1] for p in points]
    return lambda nbytes: float(numpy.interp(nbytes, sizes, seconds))


def collective_points(by_size: dict, key: str, cores: int,
                      in_step: Callable[[float], float] | None = None) -> list[tuple[float, float]]:
    """(bytes, seconds) points of what a calibrated collective costs a process's step, in groups
    of `key` ("group size/processes running"), while the other processes go on computing (a
    tensor-parallel pair's collectives while the other pairs compute; a pipeline's sends).

    With at most one process per core: its time from call to return. With more processes than
    cores, a group that fits the cores holds its members on them for the time it takes with a
    core each (measured with that many processes), and each process gets the cores processes /
    cores times less often (estimate's fixed point then scales it by how many compute at once):
    dp2 x tp2 on 4 processes and tp2 on 2 measured the same step on 2 cores, in two runs. A group
    larger than the cores: its time with every process running (none of its members can go on
    without the others). The CPU time calibration also records is not used: priced at it, dp2 x
    tp2's collectives came to half of what the runs spent on them. `in_step(bytes)` is added to
    every point, as time with a core each: what a collective costs inside a step beyond the loop's
    (or short of it), though never below the CPU time the loop saw the call take."""
    size, processes = (int(n) for n in key.split("/"))
    alone = f"{size}/{size}"
    shared = not (processes <= cores or size > cores or alone not in by_size)
    points = [[p[0], max(p[1] + in_step(p[0]), p[2] if len(p) > 2 else 0.0) if in_step else p[1]]
              for p in by_size[alone if shared else key]["points"]]
    return [(nbytes, seconds * (processes / cores if shared else 1.0)) for nbytes, seconds in monotone(points)]


def monotone(points: list[list[float]]) -> list[tuple[float, float]]:
    """Measured (bytes, seconds) with no message cheaper than a smaller one: each point's seconds
    at most those of any larger message. A slow spell of the machine in one size's repeats (here
    4.6 ms at 256 KiB between 3.3 ms at 64 KiB and 1 MiB) is not a property of that size."""
    out, cheapest = [], float("inf")
    for nbytes, seconds in sorted(points, reverse=True):
        cheapest = min(cheapest, seconds)
        out.append((nbytes, cheapest))
    return out[::-1]


def _free_disk(disk: dict) -> float:
    """Free bytes where `strata calibrate` measured the disk: now, if the directory is still
    there (space comes and goes), else as measured."""
    directory = disk.get("directory")
    if directory and os.path.isdir(directory):
        return float(shutil.disk_usage(directory).free)
    return float(disk.get("free_bytes", 0.0))


def workload(model: ModelConfig, global_batch: int, seq_len: int | None, precision: str,
             optimizer: str = "adamw", bucket_mb: float = BUCKET_MB, fp8: bool = False) -> Workload:
    if precision not in BYTES:
        raise ConfigError(f"--precision {precision}: valid: {', '.join(BYTES)}")
    check_optimizer(optimizer)
    seq_len = model.max_seq_len if seq_len is None else seq_len
    check_workload(model, seq_len, global_batch)
    return Workload(model, global_batch, seq_len, precision, optimizer, bucket_mb=bucket_mb, fp8=fp8)
