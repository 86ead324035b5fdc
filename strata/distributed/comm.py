"""Every collective strata issues goes through here: it is counted (bytes each rank sends, by
operation and process group, from the ring algorithm's volume) and bounded by the process group's
timeout, and a failure names the operation and the group.

Volumes per rank for a tensor of n bytes on a group of N ranks (ring algorithms, as nccl-tests
count them): all-reduce 2(N-1)/N·n; reduce-scatter (N-1)/N·n of its input; all-gather (N-1)/N·n of
its output; broadcast n; a point-to-point send n (counted by the sender only)."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist


class CommCounter:
    """Bytes sent per rank, keyed by (operation, group name)."""

    def __init__(self):
        self.bytes_sent: dict[tuple[str, str], float] = defaultdict(float)

    def add(self, op: str, group_name: str, nbytes: float) -> None:
        self.bytes_sent[(op, group_name)] += nbytes

    def total(self, op: str | None = None) -> float:
        return sum(v for (o, _), v in self.bytes_sent.items() if op is None or o == op)

    def by_op(self) -> dict[str, float]:
        return {f"{op}/{group}": nbytes for (op, group), nbytes in self.bytes_sent.items()}

    def reset(self) -> None:
        self.bytes_sent.clear()


# One counter per process, like a logger: the trainer reads and resets it once per step.
counter = CommCounter()


class _Pending:
    """An async collective: wait() re-raises a failure with the operation and group named."""

    def __init__(self, work, op: str, group_name: str):
        self.work, self.op, self.group_name = work, op, group_name

    def wait(self) -> None:
        _run(self.op, self.group_name, self.work.wait)


def _run(op: str, group_name: str, call):
    try:
        return call()
    except RuntimeError as e:
        raise RuntimeError(f"collective {op} on process group {group_name!r} failed: {e}") from e


def _issue(op: str, group_name: str, nbytes: float, call, async_op: bool):
    counter.add(op, group_name, nbytes)
    work = _run(op, group_name, call)
    return _Pending(work, op, group_name) if async_op else None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor, group, group_name: str, op=dist.ReduceOp.SUM, async_op: bool = False):
    n = dist.get_world_size(group)
    return _issue("all_reduce", group_name, 2 * (n - 1) / n * _nbytes(tensor),
                  lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op), async_op)


def reduce_scatter(output, input, group, group_name: str, async_op: bool = False):
    """Sum `input` over the group; rank r gets slice r in `output` (which may alias that slice)."""
    n = dist.get_world_size(group)
    return _issue("reduce_scatter", group_name, (n - 1) / n * _nbytes(input),
                  lambda: dist.reduce_scatter_single(output, input, group=group, async_op=async_op), async_op)


def all_gather(output, input, group, group_name: str, async_op: bool = False):
    """Concatenate every rank's `input` into `output` (input may alias this rank's slice)."""
    n = dist.get_world_size(group)
    return _issue("all_gather", group_name, (n - 1) / n * _nbytes(output),
                  lambda: dist.all_gather_single(output, input, group=group, async_op=async_op), async_op)


def broadcast(tensor, src_group_rank: int, group, group_name: str) -> None:
    _issue("broadcast", group_name, _nbytes(tensor),
           lambda: dist.broadcast(tensor, group=group, group_src=src_group_rank), False)


def barrier(group=None, group_name: str = "world") -> None:
    _run("barrier", group_name, lambda: dist.barrier(group=group))


def send_recv(sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]],
              group, group_name: str) -> list[_Pending]:
    """Post point-to-point sends and receives together, each (tensor, peer's global rank, tag), as
    one `batch_isend_irecv`: NCCL needs a send and the receive its peer posts at the same time in
    one group, or both ranks block; gloo takes them one by one. Returns one handle per operation,
    sends first. Tags keep gloo from matching a message to the wrong receive; NCCL ignores them
    and matches in order, which the schedules keep consistent."""
    ops = [dist.P2POp(dist.isend, t, peer, group, tag) for t, peer, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group, tag) for t, peer, tag in recvs]
    if not ops:
        return []
    for t, _, _ in sends:
        counter.add("send", group_name, _nbytes(t))
    works = _run("send_recv", group_name, lambda: dist.batch_isend_irecv(ops))
    return [_Pending(w, "send" if i < len(sends) else "recv", group_name) for i, w in enumerate(works)]
