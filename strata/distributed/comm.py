"""Every collective strata issues goes through here: it is counted (bytes each rank sends, by
operation and process group, from the ring algorithm's volume) and bounded by the process group's
timeout, and a failure names the operation and the group.

Volumes per rank for n bytes on a group of N ranks (ring algorithms, as in nccl-tests):
all-reduce 2(N-1)/N·n; reduce-scatter and all-gather (N-1)/N·n of the full tensor; broadcast n."""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist


class CommCounter:
    """Bytes sent per rank, keyed by (operation, group name)."""

    def __init__(self):
        self.bytes_sent: dict[tuple[str, str], float] = defaultdict(float)

    def add(self, op: str, group_name: str, nbytes: float) -> None:
        self.bytes_sent[(op, group_name)] += nbytes

    def total(self) -> float:
        return sum(self.bytes_sent.values())

    def by_op(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for (op, group), nbytes in self.bytes_sent.items():
            out[f"{op}/{group}"] += nbytes
        return dict(out)

    def reset(self) -> None:
        self.bytes_sent.clear()


# One counter per process, like a logger: the trainer reads and resets it once per step.
counter = CommCounter()


@contextmanager
def _named(op: str, group_name: str):
    try:
        yield
    except RuntimeError as e:
        raise RuntimeError(f"collective {op} on process group {group_name!r} failed: {e}") from e


def all_reduce(tensor: torch.Tensor, group, group_name: str, op=dist.ReduceOp.SUM) -> None:
    n = dist.get_world_size(group)
    counter.add("all_reduce", group_name, 2 * (n - 1) / n * tensor.numel() * tensor.element_size())
    with _named("all_reduce", group_name):
        dist.all_reduce(tensor, op=op, group=group)


def broadcast(tensor: torch.Tensor, src_group_rank: int, group, group_name: str) -> None:
    counter.add("broadcast", group_name, tensor.numel() * tensor.element_size())
    with _named("broadcast", group_name):
        dist.broadcast(tensor, group=group, group_src=src_group_rank)
