"""The link model: a cluster's devices and links, and the time of one collective over a group of
its devices, as NCCL runs it: the fastest of its algorithms that the group and the fabric allow
(ring; a tree across nodes; in-network reduction by NVLink SHARP inside an NVSwitch node or by
SHARP switches across nodes), alpha-beta on the slowest link the group crosses; or the calibrated
numbers of this machine. Every term and its source is in docs/cost-model.md."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from strata.plan.hardware import Device


@dataclass(frozen=True)
class Cluster:
    device: Device
    nodes: int = 1
    devices_per_node: int = 8
    intra_bandwidth: float = 0.0  # bytes/s per direction per device inside a node
    inter_bandwidth: float = 0.0  # bytes/s per direction per node between nodes
    intra_latency: float = 5e-6  # seconds per ring step (alpha)
    inter_latency: float = 10e-6
    # None: compute time from the shapes of the work on the device's kernels (strata/plan/compute.py);
    # a number (--efficiency): every FLOP at that fraction of the peak, as the first planner did
    efficiency: float | None = None
    # cpu-local only: measured bandwidth/latency per collective and group size (strata calibrate):
    # what one costs a process while other processes compute through its wait, and (together) its
    # time when every process is in one at once, as in the step's data-parallel sums
    collectives: dict = field(default_factory=dict, compare=False, hash=False)
    collectives_together: dict = field(default_factory=dict, compare=False, hash=False)
    # Communication runs beside compute (GPUs: its own engines); on a CPU it takes the cores.
    overlap: bool = True
    # cpu-local: processes share this many cores; the device's peak is the rate with all busy
    shared_cores: int = 0
    # in-network reduction the fabric offers NCCL: "nvls" (NVLink SHARP, an NVSwitch node's
    # all-reduce), "sharp" (InfiniBand switches that reduce: NCCL's CollNet)
    in_network: frozenset = frozenset()

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node


def core_split(processes: float, cores: int) -> float:
    """What of one core each of `processes` processes busy at once gets on `cores` cores (cpu-local):
    all of one while there are enough, else an even split. The planner's share of a calibrated
    count and the estimate's fixed point both take it from here."""
    return min(1.0, cores / processes)


def members_per_node(cluster: Cluster, size: int, stride: int) -> int:
    """How many of a group's `size` members, `stride` ranks apart, share a node."""
    per_node = cluster.devices_per_node
    if size * stride <= per_node:
        return size
    return max(1, per_node // stride) if stride < per_node else 1


def group_link(cluster: Cluster, size: int, stride: int) -> tuple[float, float, bool]:
    """(bandwidth per direction each member gets, latency per step, crosses nodes) for a group of
    `size` devices `stride` ranks apart, when every group of its kind communicates at once."""
    if size <= 1:
        return float("inf"), 0.0, False
    per_node = cluster.devices_per_node
    if size * stride <= per_node:
        return cluster.intra_bandwidth, cluster.intra_latency, False
    members = members_per_node(cluster, size, stride)
    groups_per_node = per_node // members  # rings that leave each node at once
    across = cluster.inter_bandwidth / groups_per_node
    inside = cluster.intra_bandwidth if members > 1 else float("inf")
    return min(across, inside), cluster.inter_latency, True


def collective_seconds(cluster: Cluster, op: str, nbytes: float, size: int, stride: int,
                       together: bool = False) -> float:
    """Ring alpha-beta time of one collective of `nbytes` (the full tensor) over `size` ranks.
    With a calibrated profile (cpu-local), its measured numbers for this op and group size;
    together: every rank of the cluster is in one at the same moment (no process computes
    through the wait)."""
    if size <= 1 or nbytes == 0:
        return 0.0
    by_size = (cluster.collectives_together if together else cluster.collectives).get(op, {})
    measured = by_size.get(f"{size}/{cluster.world}", by_size.get(str(size)))
    if measured is not None:
        return measured_seconds(measured, nbytes)
    bandwidth, latency, crosses = group_link(cluster, size, stride)
    if op == "all_reduce":
        return min(seconds for _, seconds in all_reduce_algorithms(cluster, nbytes, size, stride))
    if op in ("all_gather", "reduce_scatter"):
        return (size - 1) * latency + (size - 1) / size * nbytes / bandwidth
    if op == "send":
        return latency + nbytes / bandwidth
    raise ValueError(f"unknown collective {op!r}")


def all_reduce_algorithms(cluster: Cluster, nbytes: float, size: int, stride: int) -> list[tuple[str, float]]:
    """(algorithm, seconds) of each way NCCL can all-reduce `nbytes` over the group (it picks the
    fastest by size and scale, as its tuner does):
      ring   2(N-1) alpha + 2(N-1)/N n/B: every step pays the slowest link's latency
      tree   across nodes, NCCL's double binary tree: a chain through each node's members and a
             tree over the nodes, 2 (ceil(log2 nodes) alpha_inter + (m-1) alpha_intra) + 2 n/B
      nvls   an NVSwitch node's in-network reduction (NVLink SHARP): each member sends and
             receives n once, 2 alpha + n/B
      sharp  switches that reduce across nodes (CollNet): the node's share crosses once each
             way, a reduction inside the node either side, 2 (alpha_inter + alpha_intra) + n/B"""
    bandwidth, latency, crosses = group_link(cluster, size, stride)
    found = [("ring", 2 * (size - 1) * latency + 2 * (size - 1) / size * nbytes / bandwidth)]
    if not crosses:
        if "nvls" in cluster.in_network:
            found.append(("nvls", 2 * latency + nbytes / bandwidth))
        return found
    members = members_per_node(cluster, size, stride)
    nodes = math.ceil(size / members)
    chain = (members - 1) * cluster.intra_latency
    found.append(("tree", 2 * (math.ceil(math.log2(nodes)) * cluster.inter_latency + chain) + 2 * nbytes / bandwidth))
    if "sharp" in cluster.in_network:
        found.append(("sharp", 2 * (cluster.inter_latency + cluster.intra_latency) + nbytes / bandwidth))
    return found


def measured_seconds(points: list[list[float]], nbytes: float) -> float:
    """Time of a collective from calibrated (bytes, seconds) points: alpha-beta between the two
    measured sizes around nbytes (latency and bandwidth of that range), the end segments extended."""
    i = next((k for k in range(1, len(points) - 1) if nbytes <= points[k][0]), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    per_byte = max((y1 - y0) / (x1 - x0), 0.0)
    return max(y0 + (nbytes - x0) * per_byte, 0.0)




def all_to_all_seconds(cluster: Cluster, sent: float, size: int, members_per_node: int) -> float:
    """One all-to-all over `size` ranks, `members_per_node` of them in each node, each rank sending
    `sent` bytes split evenly among the others, while every rank of the cluster does the same (a
    mixture's layers run on all ranks at once). The share to peers in the same node goes over the
    intra-node link; the rest leaves through the node's network links, which carry every device's
    share at once (an all-to-all is bound by the bisection, not by a ring's one crossing per step).
    Each peer is one message: (size - 1) latencies."""
    if size <= 1 or sent == 0:
        return 0.0
    inside = max(1, min(members_per_node, size))
    on_node = sent * (inside - 1) / (size - 1)
    off_node = sent - on_node
    seconds = on_node / cluster.intra_bandwidth if on_node else 0.0
    if off_node:
        seconds = max(seconds, off_node * cluster.devices_per_node / cluster.inter_bandwidth)
    return (size - 1) * (cluster.inter_latency if off_node else cluster.intra_latency) + seconds
