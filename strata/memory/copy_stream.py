"""Where an offload tier's copies run: on an accelerator, a stream of their own beside the compute
stream, ordered against it by events; on a CPU, in line, as plain copies (issue 53).

Every transfer is asked for on the thread that queues compute and carried out later on a tier's
worker thread (strata/memory/tiers.py), so the order of the two streams is stated with events:

    after = copies.after_compute()         # asking thread: a mark on the compute stream, now
    ... on the worker:
    with copies.issue(after):              # the copy stream waits the mark, and is current
        copies.copy(dst, src)              # queued on the copy stream, the host does not wait
        ready = copies.landed(dst)         # an event after the copy
    ready.host_wait()                      # a write: the worker waits, before the host copy is
                                           #   used or the device memory is freed
    ready.wait_on()                        # a read: the asking thread's compute stream waits
                                           #   the event (a device-side wait, no host sync)

The mark makes a write copy what the compute queued before it produced, and keeps a read from
writing into memory the compute stream has freed but may still be reading. A read's destination is
recorded on the compute stream (`record_stream`) when the compute stream waits for it: its memory
was allocated on the copy stream (the worker resizes it there), so whoever frees it later, the copy
stream will not reuse it before the compute that read it has run.

On a CPU `after_compute` is None, `issue` does nothing, a copy is done when it returns and `landed`
is None: the tier behaves exactly as it did before it had a copy stream."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch


class Ready:
    """An event on the copy stream after some copies, and the tensors they wrote or read."""

    def __init__(self, event, tensors: tuple[torch.Tensor, ...], device: torch.device):
        self.event, self.tensors, self.device = event, tensors, device

    def wait_on(self, stream=None) -> None:
        """Make `stream` (the calling thread's current one: compute) wait for the copies, on the
        device: the host goes on. Its later work may use the tensors."""
        stream = stream if stream is not None else torch.accelerator.current_stream(self.device)
        stream.wait_event(self.event)
        for tensor in self.tensors:
            tensor.record_stream(stream)  # used there now: not reused by the copy stream before

    def host_wait(self) -> None:
        """Block this thread (a tier's worker) until the copies are done."""
        self.event.synchronize()


class HostCopies:
    """A CPU device: host memory is the device's, a copy is done when it returns."""

    def after_compute(self):
        return None

    def issue(self, after):
        return nullcontext()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def landed(self, *tensors: torch.Tensor) -> Ready | None:
        return None


class CopyStream:
    """An accelerator's stream for one tier's copies (host memory pinned, so they run beside the
    compute kernels), through torch's device-generic Stream and Event."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = torch.Stream(device=self.device)

    def after_compute(self):
        """A mark after the work queued so far on the calling thread's current (compute) stream."""
        return torch.accelerator.current_stream(self.device).record_event()

    @contextmanager
    def issue(self, after):
        """The copy stream current in the block (its copies and allocations go there), after the
        compute that `after` marks."""
        if after is not None:
            self.stream.wait_event(after)
        with self.stream:
            yield

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def landed(self, *tensors: torch.Tensor) -> Ready:
        return Ready(self.stream.record_event(), tensors, self.device)


def for_device(device: torch.device) -> HostCopies | CopyStream:
    """The copies for tensors on `device` (tests replace this to record the device path's order)."""
    return HostCopies() if torch.device(device).type == "cpu" else CopyStream(device)


def wait_for(result) -> None:
    """After a transfer's Future has returned `result` (on the asking thread): the compute stream
    waits for a read's copies (a Ready); anything else is already done."""
    if isinstance(result, Ready):
        result.wait_on()
