"""NCCL's execution rules, enforced on gloo: `comm_semantics = nccl` rehearses a GPU layout on a CPU.

gloo forgives what NCCL does not. Under this mode strata's communication layer (comm.py) runs
every operation as NCCL would, so code that would hang or crash on a GPU cluster hangs or crashes
here, in a test, and is reported within the run's timeout:

- One stream per communicator: each process group's operations run one at a time, in the order
  they were issued, on one thread of their own (`Stream`); an operation starts when the one before
  it on its group has finished. Groups run concurrently, as NCCL's communicators do.
- Rendezvous sends: a send completes only once its receive is posted (gloo's sends already wait,
  at every size; NCCL's do above a few MB). Together with the first rule, a send waiting on its
  group blocks everything issued after it there.
- A batched point-to-point call is one operation with one handle (torch coalesces NCCL's batch).
- Tags are ignored: a pair's messages on a group match in the order they were posted (comm.py
  posts every message with tag 0).
- Device tensors only: every tensor handed to a device group is on the run's device and contiguous.
  On a CPU host and device are one, so a tensor made without a device (torch.tensor([...]) and the
  other factories, called without device=) is marked as made on the host (`HostTensors`); comm.py
  refuses a marked tensor, naming the operation. Only the tensor the factory returned carries the
  mark (what an operation derives from it does not): the static check in the tests covers the rest.
- Waits order work but never time out: a wait blocks until its operation finishes; a `Watchdog`
  fails an operation that has run longer than its group's timeout, naming the group, the
  operation and its sequence number, and aborts every operation still queued (NCCL's watchdog
  aborts the communicator and the process). With TORCH_NCCL_DUMP_ON_TIMEOUT set it writes the
  flight recorder's dump first and signals every other rank, through the job's store, to write
  theirs, as NCCL does (strata/distributed/flight_recorder.py reads them)."""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch

from strata.distributed import flight_recorder


class Operation:
    """One operation on a stream: how to launch it (returns gloo's works), what it is, and when it
    has finished (or failed)."""

    def __init__(self, launch: Callable[[], list], op: str, group_name: str, seq: int, group=None,
                 peers: tuple[int, ...] = ()):
        self.launch, self.op, self.group_name, self.seq, self.group, self.peers = launch, op, group_name, seq, group, peers
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.started: float | None = None  # monotonic time its stream began it
        # autograd's modes are per thread: the stream's thread launches it in the issuing thread's
        # (a collective writing into views of a tensor made under no_grad or inference mode must too)
        self.grad_enabled, self.inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def finish(self, error: BaseException | None = None) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()

    def describe(self) -> str:
        return f"{self.op} #{self.seq} on process group {self.group_name!r}"


class Stream:
    """A process group's operations, run in issue order by one thread: NCCL's one stream per
    communicator. `timeout_s` is the group's: the watchdog fails an operation that runs longer."""

    def __init__(self, group_name: str, timeout_s: float):
        self.group_name, self.timeout_s = group_name, timeout_s
        self.backend_timeout = timedelta(seconds=2 * timeout_s + 10)
        self.queue: queue.SimpleQueue[Operation | None] = queue.SimpleQueue()
        self.pending: list[Operation] = []  # issued and not finished, in order
        self.current: Operation | None = None
        self.lock = threading.Lock()
        self.p2p_seq = 0
        self.thread = threading.Thread(target=self._run, name=f"strata-stream-{group_name}", daemon=True)
        self.thread.start()

    def submit(self, operation: Operation) -> Operation:
        with self.lock:
            self.pending.append(operation)
        self.queue.put(operation)
        return operation

    def close(self) -> None:
        """End the thread once what was issued has run (the group is no longer used)."""
        self.queue.put(None)

    def _run(self) -> None:
        while True:
            operation = self.queue.get()
            if operation is None:
                return
            if watchdog.failure is not None:  # the communicator was aborted: nothing more runs
                operation.finish(watchdog.failure)
            else:
                operation.started = time.monotonic()
                self.current = operation
                try:
                    with torch.inference_mode(operation.inference), torch.set_grad_enabled(operation.grad_enabled):
                        for work in operation.launch():
                            # with the watchdog on, gloo's own timeout comes later (a send's is the
                            # wait's), so that the watchdog is what ends a hang, as on NCCL
                            work.wait(self.backend_timeout) if watchdog.enabled else work.wait()
                    operation.finish()
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits for it
                    if watchdog.enabled:  # a failed operation aborts the communicator, as on NCCL
                        watchdog.abort(operation, e)
                    operation.finish(e)
                self.current = None
            with self.lock:
                self.pending.remove(operation)


class Watchdog:
    """Fails an operation that has run longer than its stream's timeout; then every operation
    queued anywhere fails with the same error (an aborted communicator, as after any failed
    operation). `describe(operation, cause)` gives the error, with the ranks that did not arrive
    (comm.py's); cause None: the timeout."""

    CHECK_EVERY_S = 0.2

    def __init__(self):
        self.streams: list[Stream] = []
        self.failure: BaseException | None = None
        self.store: Callable[[], object] | None = None  # the job's store (comm.py's), for the dump signal
        self.dumped, self.polls = False, 0
        self.enabled = True  # off: an operation fails only when gloo's own timeout ends it
        self.describe: Callable[[Operation, BaseException | None], BaseException] | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def watch(self, stream: Stream) -> None:
        with self._lock:
            self.streams.append(stream)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="strata-watchdog", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while self.failure is None:
            time.sleep(self.CHECK_EVERY_S)
            self._dump_when_asked()
            now = time.monotonic()
            if not self.enabled:
                continue
            for stream in list(self.streams):
                operation = stream.current
                if operation is not None and operation.started is not None \
                        and now - operation.started > stream.timeout_s:
                    self.abort(operation)
                    return

    def abort(self, operation: Operation, cause: BaseException | None = None) -> None:
        if self.failure is not None:
            return
        error = self.describe(operation, cause) if self.describe is not None else \
            cause or RuntimeError(f"{operation.describe()} did not finish within its timeout")
        if _dumps_on_timeout():  # this rank's flight record, and every other rank's (NCCL signals them)
            self._dump()
            store = self.store() if self.store is not None else None
            if store is not None:
                try:
                    store.set(DUMP_SIGNAL, "1")
                except (RuntimeError, ValueError):  # the store is gone: this rank's dump is still written
                    pass
        self.failure = error
        for stream in list(self.streams):
            with stream.lock:
                waiting = list(stream.pending)
            for pending in waiting:
                pending.finish(error)

    def _dump(self) -> None:
        if not self.dumped:
            self.dumped = True
            try:
                flight_recorder.dump()
            except OSError:  # the report still goes out without the dump
                pass

    def _dump_when_asked(self) -> None:
        """Another rank's watchdog fired: write this rank's record too, once (checked about every
        second: the store serves every rank)."""
        if self.dumped or not _dumps_on_timeout() or self.store is None:
            return
        self.polls += 1
        if self.polls % max(1, round(1 / self.CHECK_EVERY_S)):
            return
        store = self.store()
        try:
            if store is not None and store.check([DUMP_SIGNAL]):
                self._dump()
        except (RuntimeError, ValueError):
            pass

    def forget(self, stream: Stream) -> None:
        with self._lock:
            if stream in self.streams:
                self.streams.remove(stream)


DUMP_SIGNAL = "strata/flight_recorder/dump"  # set by the first rank whose watchdog fires


def _dumps_on_timeout() -> bool:
    return os.environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "0") not in ("0", "")


watchdog = Watchdog()


# --- tensors made on the host -----------------------------------------------------------------------
HOST_MADE = "_strata_host_made"
FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "rand", "randn",
             "randint", "eye", "from_numpy")


def _device_context_active() -> bool:
    """A `with torch.device(...)` block gives the factories its device."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext
    return any(isinstance(mode, DeviceContext) for mode in _get_current_function_mode_stack())


class HostTensors:
    """While installed, torch's tensor factories mark what they make without a device (the host's
    memory on a GPU machine); `is_host_made(t)` reads the mark."""

    def __init__(self):
        self.originals: dict[str, Callable] = {}

    def install(self) -> None:
        if self.originals:
            return
        # `with torch.device(...)` recognises the factories by identity, from a set it builds once:
        # built from the originals first, it still gives them its device when called through ours
        from torch.utils._device import _device_constructors
        _device_constructors()
        for name in FACTORIES:
            original = getattr(torch, name)
            self.originals[name] = original
            setattr(torch, name, _marking(original, name))

    def uninstall(self) -> None:
        for name, original in self.originals.items():
            setattr(torch, name, original)
        self.originals = {}

    @staticmethod
    def is_host_made(t: torch.Tensor) -> bool:
        return getattr(t, HOST_MADE, False)


def _marking(factory: Callable, name: str) -> Callable:
    @functools.wraps(factory)
    def made(*args, **kwargs):
        out = factory(*args, **kwargs)
        keeps_device = name == "as_tensor" and args and isinstance(args[0], torch.Tensor)
        if (name == "from_numpy" or kwargs.get("device") is None) and not keeps_device \
                and not torch.compiler.is_compiling() and not _device_context_active():
            setattr(out, HOST_MADE, True)
        return out
    return made


host_tensors = HostTensors()
