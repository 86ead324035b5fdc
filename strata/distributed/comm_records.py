"""What the communication layer (strata/distributed/comm.py) keeps of the collectives it issues:
the bytes each rank sends and the seconds they were in flight (CommCounter, read once a step),
and how many collectives each rank has entered on each group (Arrivals, posted to the rendezvous
store), from which a failed collective names the ranks that did not arrive."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from strata.distributed.timing import DeviceClock

# Seconds a failed collective waits for the other ranks' arrival records to settle before naming
# the missing ones (their posts are immediate; this covers ranks that time out a moment later).
ARRIVAL_GRACE_S = 1.5


class CommCounter:
    """Bytes sent per rank, and the seconds during which at least one collective of the kind was
    in flight (from its launch until its wait() returned; overlapping ones count once), keyed by
    (operation, group name). Times are the device clock's marks (CUDA events on a GPU, so they
    time the work, not its launch), read when the step ends."""

    def __init__(self):
        self.clock = DeviceClock(torch.device("cpu"))
        self.bytes_sent: dict[tuple[str, str], float] = defaultdict(float)
        # The host's blocked time (perf_counter start, end) in each wait for an operation, a
        # synchronous one's whole run included: the communication the step did not overlap. On
        # gloo that is the exposed time itself; on NCCL a wait only orders the streams (the
        # profiler's trace shows the device's side: bench/gpu_check.py).
        self.waits: list[tuple[str, str, float, float]] = []  # the step's first MAX_WAITS (the trace's)
        self._exposed: dict[tuple[str, str], float] = defaultdict(float)
        self._spans: dict[tuple[str, str], list] = defaultdict(list)  # (start mark, end mark) of busy spans
        self._in_flight: dict[tuple[str, str], int] = defaultdict(int)
        self._busy_since: dict[tuple[str, str], object] = {}

    def add(self, op: str, group_name: str, nbytes: float) -> None:
        self.bytes_sent[(op, group_name)] += nbytes

    def started(self, op: str, group_name: str) -> None:
        key = (op, group_name)
        if self._in_flight[key] == 0:
            self._busy_since[key] = self.clock.mark()
        self._in_flight[key] += 1

    def finished(self, op: str, group_name: str) -> None:
        key = (op, group_name)
        self._in_flight[key] -= 1
        if self._in_flight[key] == 0:
            self._spans[key].append((self._busy_since.pop(key), self.clock.mark()))

    MAX_WAITS = 1 << 14  # a tool that never resets (generation, the benchmark) keeps a bounded list

    def waited(self, op: str, group_name: str, start: float, end: float) -> None:
        self._exposed[(op, group_name)] += end - start
        if len(self.waits) < self.MAX_WAITS:
            self.waits.append((op, group_name, start, end))

    def exposed_seconds_by_op(self) -> dict[str, float]:
        """Seconds the host was blocked waiting for each kind of operation this step."""
        return {f"{op}/{group}": seconds for (op, group), seconds in self._exposed.items()}

    def seconds_by_op(self) -> dict[str, float]:
        """On CUDA, once the compute stream has passed the step's last wait (timing.synchronize_stream)."""
        return {f"{op}/{group}": sum(self.clock.seconds(start, end) for start, end in spans)
                for (op, group), spans in self._spans.items()}

    def total(self, op: str | None = None) -> float:
        return sum(v for (o, _), v in self.bytes_sent.items() if op is None or o == op)

    def by_op(self) -> dict[str, float]:
        return {f"{op}/{group}": nbytes for (op, group), nbytes in self.bytes_sent.items()}

    def reset(self) -> None:
        """A new step: counts start from zero (collectives still in flight keep their start)."""
        self.bytes_sent.clear()
        self._spans.clear()
        self.waits.clear()
        self._exposed.clear()
        for key in self._busy_since:
            self._busy_since[key] = self.clock.mark()


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
        store = rendezvous_store()
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
        store = rendezvous_store()
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


def rendezvous_store():
    """The job's rendezvous store (torchrun's), where the ranks post their arrivals; None without one."""
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None
