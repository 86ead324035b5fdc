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
ranks; broadcast n; a point-to-point send n (counted by the sender only).

Semantics (`configure`): `native` runs each operation as the backend does; `nccl` enforces NCCL's
rules on gloo (strata/distributed/rehearsal.py: one stream per group, sends that wait for their
receive, one handle per batched point-to-point, no tags, device tensors only, a watchdog instead
of timed waits). The code above this layer is written to NCCL's rules in both: it never relies
on what only gloo allows."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from strata.distributed import rehearsal
from strata.distributed.comm_records import Arrivals, CommCounter, rendezvous_store
from strata.distributed.timing import DeviceClock
from strata.errors import CollectiveError
from strata.rules.comm_semantics import resolve_semantics

# What is counted (bytes, busy seconds) and where each rank has got to (its arrivals), per process.
counter = CommCounter()
arrivals = Arrivals()


# --- semantics -----------------------------------------------------------------------------------------
# NCCL's rules as the emulation enforces them (rehearsal.py); each can be switched off alone, which
# only the tests do, to show that their case fails without it.
RULES = ("streams", "batches", "no_tags", "device_tensors", "watchdog")


class _Settings:
    def __init__(self):
        self.semantics: str | None = None  # None: not configured yet (the environment decides on first use)
        self.device = torch.device("cpu")
        self.emulate = False  # enforce NCCL's rules here: nccl semantics on a gloo device (the CPU)
        self.rules = frozenset(RULES)


_settings = _Settings()
_streams: dict[object, rehearsal.Stream] = {}  # process group (or "world") -> its stream, while emulating
_labels: dict[object, str] = {}  # process group -> the name its stream and its errors use


def configure(semantics: str | None = None, device: torch.device | None = None,
              rules: tuple[str, ...] = RULES) -> str:
    """This process's communication semantics (None: default_semantics()) and its compute device
    (device collectives take tensors on it; CUDA events time the communication there). On a CUDA
    device NCCL itself enforces the rules; on the CPU, `nccl` emulates them on gloo."""
    chosen = resolve_semantics(semantics)
    _settings.semantics, _settings.device = chosen, device or torch.device("cpu")
    _settings.emulate = chosen == "nccl" and _settings.device.type == "cpu"
    _settings.rules = frozenset(rules)
    counter.clock = DeviceClock(_settings.device)
    rehearsal.watchdog.enabled = "watchdog" in _settings.rules
    rehearsal.watchdog.describe, rehearsal.watchdog.store = _aborted, rendezvous_store
    if _settings.emulate and "device_tensors" in _settings.rules:
        rehearsal.host_tensors.install()
    else:
        rehearsal.host_tensors.uninstall()
    return chosen


def semantics() -> str:
    if _settings.semantics is None:
        configure()
    return _settings.semantics


def _emulating(rule: str = "streams") -> bool:
    """Whether NCCL's `rule` is enforced on this group's operations."""
    return semantics() == "nccl" and _settings.emulate and rule in _settings.rules


def label(group, name: str) -> None:
    """The name a group's operations are reported under when it is not the counting name (the
    pipeline's links all count as 'pp')."""
    _labels[group if group is not None else "world"] = name


def close_streams(wait_s: float = 10.0) -> None:
    """The run's groups are done with: their streams' threads end once their work has run, waited
    for (up to wait_s, a hung one is left behind) so that none is inside the backend when its
    process groups are destroyed."""
    for stream in _streams.values():
        stream.close()
        rehearsal.watchdog.forget(stream)
    deadline = time.monotonic() + wait_s
    for stream in _streams.values():
        stream.thread.join(max(0.0, deadline - time.monotonic()))
    _streams.clear()
    _labels.clear()


def _stream(group, group_name: str) -> rehearsal.Stream:
    key = group if group is not None else "world"
    if key not in _streams:
        timeout_s = _timeout_s(group)
        stream = rehearsal.Stream(_labels.get(key, group_name), timeout_s)
        if "watchdog" in _settings.rules:  # gloo's own timeout later, so that the watchdog is what ends a hang
            dist.distributed_c10d._set_pg_timeout(stream.backend_timeout, group)
        _streams[key] = stream
        rehearsal.watchdog.watch(_streams[key])
    return _streams[key]


def _timeout_s(group) -> float:
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout.total_seconds()


def _check_tensors(op: str, group_name: str, tensors, group) -> None:
    """NCCL takes contiguous tensors on the communicator's device only (on a GPU NCCL would refuse
    them too, with a less helpful error; on a CPU the rehearsal refuses them here)."""
    if semantics() != "nccl" or (_settings.emulate and "device_tensors" not in _settings.rules):
        return
    for t in tensors:
        where = f"{op} on process group {group_name!r}"
        if rehearsal.host_tensors.is_host_made(t):
            raise CollectiveError(f"{where}: a tensor made on the host (a factory called without device=) reaches "
                                  f"a device collective; NCCL takes only tensors on the run's device: make it with "
                                  f"device=", where, [])
        if t.device != _settings.device:
            raise CollectiveError(f"{where}: a tensor on {t.device}, the group's device is {_settings.device}",
                                  where, [])
        if not t.is_contiguous():
            raise CollectiveError(f"{where}: a non-contiguous tensor of shape {tuple(t.shape)}; NCCL needs "
                                  f"contiguous memory", where, [])


# --- handles -------------------------------------------------------------------------------------------
class _Pending:
    """An operation in flight: wait() re-raises a failure with the operation, group and missing ranks
    (a point-to-point operation's: its peers). Backed by the backend's works (native) or by the
    operation on its group's stream (nccl on gloo)."""

    def __init__(self, op: str, group_name: str, group=None, seq: int | None = None, works=(),
                 operation: rehearsal.Operation | None = None, timed: bool = False, peers: tuple[int, ...] = ()):
        self.op, self.group_name, self.group, self.seq, self.peers = op, group_name, group, seq, peers
        self.works, self.operation = list(works), operation
        self.timed = timed  # counted in flight until the first wait() returns

    def wait(self) -> None:
        started = time.perf_counter()
        if self.operation is not None:
            self.operation.done.wait()  # never times out itself: the watchdog ends a hung operation
            if self.operation.error is not None:
                raise _failure(self.op, self.group_name, self.operation.error, self.group, self.seq, self.peers)
        else:
            for work in self.works:
                _run(self.op, self.group_name, work.wait, self.group, self.seq, self.peers)
        counter.waited(self.op, self.group_name, started, time.perf_counter())
        if self.timed:
            counter.finished(self.op, self.group_name)
            self.timed = False

    def is_completed(self) -> bool:
        if self.operation is not None:
            return self.operation.done.is_set()
        return all(work.is_completed() for work in self.works)


def _failure(op: str, group_name: str, error: BaseException, group=None, seq: int | None = None,
             peers: tuple[int, ...] = ()) -> CollectiveError:
    """The error that names a failed operation, its group and who never arrived at it."""
    if isinstance(error, CollectiveError):
        return error
    kind = "collective " if not peers else ""
    where = f"{kind}{op}" + (f" #{seq}" if seq is not None else "") + f" on process group {group_name!r}"
    text, missing = where, []
    if peers:  # a send or receive waits for its peers, which never matched it
        text += f" (with rank{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))}, which never posted " \
                f"{'their' if len(peers) > 1 else 'its'} side)"
        missing = list(peers)
    elif seq is not None:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        words, missing = arrivals.missing(op, group_name, seq, group)
        text += f" (ranks {ranks}); ranks that did not arrive: {words}"
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    failure = CollectiveError(f"{text}: {first_line}", where, missing)
    failure.__cause__ = error
    return failure


def _aborted(operation: rehearsal.Operation, cause: BaseException | None) -> CollectiveError:
    """The watchdog's error for an operation that failed (cause) or ran past its group's timeout."""
    error = cause or TimeoutError(f"watchdog: no progress for {time.monotonic() - operation.started:.0f} s, past "
                                  f"the timeout (--timeout); NCCL would abort the communicator here")
    return _failure(operation.op, operation.group_name, error, operation.group, operation.seq, operation.peers)


def _run(op: str, group_name: str, call, group=None, seq: int | None = None, peers: tuple[int, ...] = ()):
    try:
        return call()
    except CollectiveError:
        raise
    except RuntimeError as e:
        raise _failure(op, group_name, e, group, seq, peers) from e


def _issue(op: str, group_name: str, nbytes: float, launch, async_op: bool, group=None, tensors=()):
    """Count, number and start one collective; launch(async_op) calls torch.distributed."""
    counter.add(op, group_name, nbytes)
    seq = arrivals.enter(op, group_name)
    _check_tensors(op, group_name, tensors, group)
    if _emulating():
        operation = _stream(group, group_name).submit(
            rehearsal.Operation(lambda: [launch(True)], op, group_name, seq, group))
        counter.started(op, group_name)
        handle = _Pending(op, group_name, group, seq, operation=operation, timed=True)
        if async_op:
            return handle
        handle.wait()
        return None
    counter.started(op, group_name)
    started = time.perf_counter()
    try:
        work = _run(op, group_name, lambda: launch(async_op), group, seq)
    except BaseException:
        counter.finished(op, group_name)
        raise
    if async_op:
        return _Pending(op, group_name, group, seq, works=[work], timed=True)
    counter.waited(op, group_name, started, time.perf_counter())
    counter.finished(op, group_name)
    return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --- the operations ------------------------------------------------------------------------------------
def all_reduce(tensor, group, group_name: str, op=dist.ReduceOp.SUM, async_op: bool = False):
    n = dist.get_world_size(group)
    return _issue("all_reduce", group_name, 2 * (n - 1) / n * _nbytes(tensor),
                  lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a), async_op, group, (tensor,))


def reduce_scatter(output, input, group, group_name: str, async_op: bool = False):
    """Sum `input` over the group; rank r gets slice r in `output` (which may alias that slice)."""
    n = dist.get_world_size(group)
    return _issue("reduce_scatter", group_name, (n - 1) / n * _nbytes(input),
                  lambda a: dist.reduce_scatter_single(output, input, group=group, async_op=a), async_op, group,
                  (output, input))


def all_gather(output, input, group, group_name: str, async_op: bool = False):
    """Concatenate every rank's `input` into `output` (input may alias this rank's slice)."""
    n = dist.get_world_size(group)
    return _issue("all_gather", group_name, (n - 1) / n * _nbytes(output),
                  lambda a: dist.all_gather_single(output, input, group=group, async_op=a), async_op, group,
                  (output, input))


def all_to_all(output, input, group, group_name: str, async_op: bool = False):
    """Slice j of this rank's `input` goes to rank j, which puts it at slice r (this rank's) of `output`."""
    n = dist.get_world_size(group)
    return _issue("all_to_all", group_name, (n - 1) / n * _nbytes(input),
                  lambda a: dist.all_to_all_single(output, input, group=group, async_op=a), async_op, group,
                  (output, input))


def all_to_all_uneven(output, input, output_splits: list[int], input_splits: list[int], group, group_name: str):
    """Rows [sum(input_splits[:j]), ... + input_splits[j]) of `input` go to rank j, which puts
    them at this rank's place in its `output` (rows from rank j: output_splits[j]). Counted: the
    bytes sent to the other ranks (a rank's rows to itself stay)."""
    me = dist.get_rank(group)
    row = _nbytes(input) // input.shape[0] if input.shape[0] else input[0:0].element_size() * math.prod(input.shape[1:])
    return _issue("all_to_all", group_name, row * (sum(input_splits) - input_splits[me]),
                  lambda a: dist.all_to_all_single(output, input, output_splits, input_splits, group=group,
                                                   async_op=a), False, group, (output, input))


def broadcast(tensor, src_group_rank: int, group, group_name: str) -> None:
    _issue("broadcast", group_name, _nbytes(tensor),
           lambda a: dist.broadcast(tensor, group=group, group_src=src_group_rank, async_op=a), False, group, (tensor,))


def barrier(group=None, group_name: str = "world") -> None:
    seq = arrivals.enter("barrier", group_name)
    if _emulating():
        _Pending("barrier", group_name, group, seq, operation=_stream(group, group_name).submit(
            rehearsal.Operation(lambda: [dist.barrier(group=group, async_op=True)], "barrier", group_name, seq,
                                group))).wait()
        return
    _run("barrier", group_name, lambda: dist.barrier(group=group), group, seq)


def _no_works(call) -> list:
    call()
    return []


def gather_objects(obj, group, group_name: str) -> list:
    """Every rank's picklable `obj`, in group rank order (torch's all_gather_object, which runs
    two collectives of its own: on the group's stream like any other operation)."""
    everyone = [None] * dist.get_world_size(group)
    seq = arrivals.enter("all_gather_object", group_name)
    call = lambda: dist.all_gather_object(everyone, obj, group=group)  # noqa: E731
    if _emulating():
        _Pending("all_gather_object", group_name, group, seq, operation=_stream(group, group_name).submit(
            rehearsal.Operation(lambda: _no_works(call), "all_gather_object", group_name, seq, group))).wait()
    else:
        _run("all_gather_object", group_name, call, group, seq)
    return everyone


def send_recv(sends: list[tuple], recvs: list[tuple], group, group_name: str) -> _Pending | None:
    """Post point-to-point sends and receives together, each (tensor, peer's global rank) or
    (tensor, peer, tag), as one `batch_isend_irecv`; one handle for the whole batch (NCCL coalesces
    the batch into one operation, whose sends complete when their receives are posted and whose
    receives when their data has landed), None when there is nothing to post. Tags are gloo's
    only: NCCL matches the messages between two ranks on a group in the order they were posted
    (and so does the nccl semantics), so strata never relies on them; a caller gives each stream
    of messages that could be confused a group of its own (the pipeline's links)."""
    if not sends and not recvs:
        return None
    for t, *_ in sends:
        counter.add("send", group_name, _nbytes(t))
    op = "send" if not recvs else "recv" if not sends else "send_recv"
    peers = tuple(sorted({peer for _, peer, *_ in [*sends, *recvs]}))
    name = _labels.get(group if group is not None else "world", group_name)
    tagged = not _emulating("no_tags")

    def p2p(kind, t, peer, *tag):
        return dist.P2POp(kind, t, peer, group, tag[0] if tag and tagged else 0)

    ops = [p2p(dist.isend, *send) for send in sends] + [p2p(dist.irecv, *recv) for recv in recvs]
    _check_tensors(op, name, [t for t, *_ in [*sends, *recvs]], group)
    if not _emulating():
        return _Pending(op, name, group, works=_run(op, name, lambda: dist.batch_isend_irecv(ops), group, peers=peers),
                        peers=peers)
    stream = _stream(group, group_name)
    # NCCL runs a batch as one operation; without the rule its parts would run one by one, in order
    batches = [ops] if _emulating("batches") else [[p] for p in ops]
    for part in batches:
        stream.p2p_seq += 1
        operation = stream.submit(rehearsal.Operation(lambda part=part: dist.batch_isend_irecv(part), op, name,
                                                      stream.p2p_seq, group, peers))
    return _Pending(op, name, group, stream.p2p_seq, operation=operation, peers=peers)
