"""Every collective strata issues goes through here: it is counted (bytes each rank sends, by
operation and process group, from the ring algorithm's volume) and bounded by the process group's
timeout, and a failure names the operation, the group and the ranks that did not arrive.

Arrivals: each rank numbers the collectives it enters on each group and posts the numbers to the
rendezvous store from a background thread. When a collective fails, the error compares the
group's posted numbers with this rank's: a rank behind it never reached the collective (it hangs
elsewhere, skipped it, or died); a rank at the same number in another operation took a different
path through the code.

Volumes per rank for a tensor of n bytes on a group of N ranks (ring algorithms, as nccl-tests
count them): all-reduce 2(N-1)/N·n; reduce-scatter (N-1)/N·n of its input; all-gather (N-1)/N·n of
its output; all-to-all (N-1)/N·n of its input, or with uneven splits the rows sent to the other
ranks; broadcast n; a point-to-point send n (counted by the sender only)."""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from strata.errors import CollectiveError

# Seconds a failed collective waits for the other ranks' arrival records to settle before naming
# the missing ones (their posts are immediate; this covers ranks that time out a moment later).
ARRIVAL_GRACE_S = 1.5


class CommCounter:
    """Bytes sent per rank, and the seconds during which at least one collective of the kind was
    in flight (from its launch until its wait() returned; overlapping ones count once), keyed by
    (operation, group name)."""

    def __init__(self):
        self.bytes_sent: dict[tuple[str, str], float] = defaultdict(float)
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self._in_flight: dict[tuple[str, str], int] = defaultdict(int)
        self._busy_since: dict[tuple[str, str], float] = {}

    def add(self, op: str, group_name: str, nbytes: float) -> None:
        self.bytes_sent[(op, group_name)] += nbytes

    def started(self, op: str, group_name: str) -> None:
        key = (op, group_name)
        if self._in_flight[key] == 0:
            self._busy_since[key] = time.perf_counter()
        self._in_flight[key] += 1

    def finished(self, op: str, group_name: str) -> None:
        key = (op, group_name)
        self._in_flight[key] -= 1
        if self._in_flight[key] == 0:
            self.seconds[key] += time.perf_counter() - self._busy_since.pop(key)

    def seconds_by_op(self) -> dict[str, float]:
        return {f"{op}/{group}": s for (op, group), s in self.seconds.items()}

    def total(self, op: str | None = None) -> float:
        return sum(v for (o, _), v in self.bytes_sent.items() if op is None or o == op)

    def by_op(self) -> dict[str, float]:
        return {f"{op}/{group}": nbytes for (op, group), nbytes in self.bytes_sent.items()}

    def reset(self) -> None:
        """A new step: counts start from zero (collectives still in flight keep their start)."""
        self.bytes_sent.clear()
        self.seconds.clear()
        for key in self._busy_since:
            self._busy_since[key] = time.perf_counter()


# One counter per process, like a logger: the trainer reads and resets it once per step.
counter = CommCounter()


class Arrivals:
    """This process's count of collectives entered per group name. A daemon thread posts the
    counts to the rendezvous store when they change, at most every POST_EVERY_S: a few writes per
    rank per second whatever the collective rate (the store serves every rank of the job), and a
    hung rank's last position is there within that time."""

    POST_EVERY_S = 0.5

    def __init__(self):
        self.count: dict[str, int] = defaultdict(int)
        self.last_op: dict[str, str] = {}
        self._posted: dict[str, str] = {}
        self._thread: threading.Thread | None = None

    def enter(self, op: str, group_name: str) -> int:
        self.count[group_name] += 1
        self.last_op[group_name] = op
        if self._thread is None or not self._thread.is_alive():  # also in a forked child
            self._thread = threading.Thread(target=self._post_forever, name="strata-arrivals", daemon=True)
            self._thread.start()
        return self.count[group_name]

    def _post_forever(self) -> None:
        while True:
            time.sleep(self.POST_EVERY_S)
            self.post()

    def post(self) -> None:
        store = _store()
        if store is None:
            return
        for name, seq in list(self.count.items()):
            value = f"{seq} {self.last_op[name]}"
            if self._posted.get(name) != value:
                try:
                    store.set(f"strata/arrived/{name}/{dist.get_rank()}", value)
                except (RuntimeError, ValueError):  # the process group is being torn down
                    return
                self._posted[name] = value

    def missing(self, op: str, group_name: str, seq: int, group) -> tuple[str, list[int]]:
        """Which ranks of `group` have not entered collective number `seq` (this rank's): in words,
        and the ranks."""
        store = _store()
        if store is None:
            return "unknown (no rendezvous store)", []
        self.post()
        time.sleep(ARRIVAL_GRACE_S)  # every other rank's thread has posted its latest by now
        behind, ranks = [], []
        for rank in dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()):
            key = f"strata/arrived/{group_name}/{rank}"
            if rank == dist.get_rank():
                continue
            if not store.check([key]):
                behind.append(f"{rank} (entered none)")
            else:
                their_seq, their_op = store.get(key).decode().split(" ", 1)
                if int(their_seq) < seq:
                    behind.append(f"{rank} (last entered #{their_seq} {their_op})")
                elif int(their_seq) == seq and their_op != op:
                    behind.append(f"{rank} (is in {their_op} #{seq} instead)")
                else:
                    continue
            ranks.append(rank)
        return (", ".join(behind) if behind else "none (all entered it; a rank may have died inside it)"), ranks


arrivals = Arrivals()


def _store():
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


class _Pending:
    """An async collective: wait() re-raises a failure with the operation, group and missing ranks
    (a point-to-point operation's: its peer)."""

    def __init__(self, work, op: str, group_name: str, group=None, seq: int | None = None, timed: bool = False,
                 peer: int | None = None):
        self.work, self.op, self.group_name, self.group, self.seq = work, op, group_name, group, seq
        self.timed = timed  # counted in flight until the first wait() returns
        self.peer = peer

    def wait(self) -> None:
        _run(self.op, self.group_name, self.work.wait, self.group, self.seq, self.peer)
        if self.timed:
            counter.finished(self.op, self.group_name)
            self.timed = False


def _run(op: str, group_name: str, call, group=None, seq: int | None = None, peer: int | None = None):
    try:
        return call()
    except CollectiveError:
        raise
    except RuntimeError as e:
        where = f"collective {op}" + (f" #{seq}" if seq is not None else "") + f" on process group {group_name!r}"
        text, missing = where, []
        if peer is not None:  # a send or receive waits for one rank: its peer, which never matched it
            text += f" (with rank {peer}, which never posted its side)"
            missing = [peer]
        elif seq is not None:
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            words, missing = arrivals.missing(op, group_name, seq, group)
            text += f" (ranks {ranks}); ranks that did not arrive: {words}"
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CollectiveError(f"{text}: {first_line}", where, missing) from e


def _issue(op: str, group_name: str, nbytes: float, call, async_op: bool, group=None):
    counter.add(op, group_name, nbytes)
    seq = arrivals.enter(op, group_name)
    counter.started(op, group_name)
    try:
        work = _run(op, group_name, call, group, seq)
    except BaseException:
        counter.finished(op, group_name)
        raise
    if async_op:
        return _Pending(work, op, group_name, group, seq, timed=True)
    counter.finished(op, group_name)
    return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor, group, group_name: str, op=dist.ReduceOp.SUM, async_op: bool = False):
    n = dist.get_world_size(group)
    return _issue("all_reduce", group_name, 2 * (n - 1) / n * _nbytes(tensor),
                  lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op), async_op, group)


def reduce_scatter(output, input, group, group_name: str, async_op: bool = False):
    """Sum `input` over the group; rank r gets slice r in `output` (which may alias that slice)."""
    n = dist.get_world_size(group)
    return _issue("reduce_scatter", group_name, (n - 1) / n * _nbytes(input),
                  lambda: dist.reduce_scatter_single(output, input, group=group, async_op=async_op), async_op, group)


def all_gather(output, input, group, group_name: str, async_op: bool = False):
    """Concatenate every rank's `input` into `output` (input may alias this rank's slice)."""
    n = dist.get_world_size(group)
    return _issue("all_gather", group_name, (n - 1) / n * _nbytes(output),
                  lambda: dist.all_gather_single(output, input, group=group, async_op=async_op), async_op, group)


def all_to_all(output, input, group, group_name: str, async_op: bool = False):
    """Slice j of this rank's `input` goes to rank j, which puts it at slice r (this rank's) of `output`."""
    n = dist.get_world_size(group)
    return _issue("all_to_all", group_name, (n - 1) / n * _nbytes(input),
                  lambda: dist.all_to_all_single(output, input, group=group, async_op=async_op), async_op, group)


def all_to_all_uneven(output, input, output_splits: list[int], input_splits: list[int], group, group_name: str):
    """Rows [sum(input_splits[:j]), ... + input_splits[j]) of `input` go to rank j, which puts
    them at this rank's place in its `output` (rows from rank j: output_splits[j]). Counted: the
    bytes sent to the other ranks (a rank's rows to itself stay)."""
    me = dist.get_rank(group)
    row = _nbytes(input) // input.shape[0] if input.shape[0] else input[0:0].element_size() * math.prod(input.shape[1:])
    return _issue("all_to_all", group_name, row * (sum(input_splits) - input_splits[me]),
                  lambda: dist.all_to_all_single(output, input, output_splits, input_splits, group=group), False, group)


def broadcast(tensor, src_group_rank: int, group, group_name: str) -> None:
    _issue("broadcast", group_name, _nbytes(tensor),
           lambda: dist.broadcast(tensor, group=group, group_src=src_group_rank), False, group)


def barrier(group=None, group_name: str = "world") -> None:
    _run("barrier", group_name, lambda: dist.barrier(group=group), group, arrivals.enter("barrier", group_name))


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
    peers = [peer for _, peer, _ in sends] + [peer for _, peer, _ in recvs]
    return [_Pending(w, "send" if i < len(sends) else "recv", group_name, peer=peer)
            for i, (w, peer) in enumerate(zip(works, peers))]
