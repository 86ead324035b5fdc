"""Timing the device's work, not the host's launches.

A GPU runs behind the host: `time.perf_counter()` around a kernel or a collective times its launch,
and a device-wide `torch.cuda.synchronize()` to line the two up waits for every stream, including
communication still in flight on purpose (an asynchronous pipeline's run-ahead send, whose receive
is posted in the next step, would never finish and the synchronize would hang). So on CUDA a point
in time is an event recorded on the current stream, and durations are read once that stream has
reached them (`synchronize_stream`, which waits for the compute stream only); on a CPU the host
clock is the device's clock.

    clock = DeviceClock(device)
    start = clock.mark()
    ...                                  # kernels, collectives waited for on this stream
    end = clock.mark()
    synchronize_stream(device)           # once, where the step ends
    seconds = clock.seconds(start, end)"""

from __future__ import annotations

import time

import torch


class DeviceClock:
    """Points in the order of the current stream's work: CUDA events on a GPU, host times on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        """The time between two marks; on CUDA, once the stream has passed `end` (synchronize_stream)."""
        if self.cuda:
            return start.elapsed_time(end) / 1e3
        return end - start


def synchronize_stream(device: torch.device) -> None:
    """Wait for the current stream's work on `device` (the compute stream, and what it waited for),
    not the whole device: communication that nothing has waited for yet stays in flight."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
