"""Bucket reductions: what ZeRO-0/1/2 (strata/parallel/gradients.py) share to overlap gradient
communication with backward (Li et al., "PyTorch Distributed", VLDB 2020). Each bucket's arriving
gradients are counted by post-accumulate-grad hooks and its collective starts when the last one is
in; the stage says what a reduction does and how many may be outstanding (its `limit`:
rules/buckets.in_flight_limit).

The throttle never waits for what is done: on NCCL, `wait()` makes the current stream, backward's,
wait for the collective, so a wait inside a gradient hook stalls backward whenever communication
is behind. Each launch first retires every reduction that has completed (`is_completed()`, a
query that never blocks, on gloo's works, NCCL's and the emulation's handles alike), and waits
for the oldest only while more than `limit` are still outstanding. A retired reduction is
finished out of launch order when an older one is still running: a stage's `finish` touches its
own bucket's ranges only (strata/parallel/gradients.py). ZeRO-3's reduce-scatters
(strata/parallel/zero3_hooks.py) go through the same queue, InFlight."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import nn

from strata.parallel.buckets import Bucket


class InFlight:
    """Collectives in flight, oldest first, each finished once by `finish(key)`: adding one first
    retires every one already done (a query that never blocks), then waits for the oldest only
    while more than `limit` are still running (None: no limit). A work of None (one process, no
    collective) is done at once."""

    def __init__(self, finish: Callable[[object], None], limit: int | None):
        self.finish, self.limit = finish, limit
        self.entries: list = []  # (key, work)

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, key, work) -> None:
        self.entries.append((key, work))
        self.retire_completed()
        while self.limit is not None and len(self.entries) > self.limit:
            self.complete_oldest()

    def retire_completed(self) -> None:
        """Finish every collective that is done, in launch order, without waiting for the others
        (its wait() returns at once: it settles the handle's accounting and, on NCCL, orders the
        current stream after work that has already ended)."""
        running, done = [], []
        for entry in self.entries:
            (done if entry[1] is None or entry[1].is_completed() else running).append(entry)
        self.entries = running
        for key, work in done:
            self._finish(key, work)

    def complete_oldest(self) -> None:
        self._finish(*self.entries.pop(0))

    def complete_all(self) -> None:
        while self.entries:
            self.complete_oldest()

    def _finish(self, key, work) -> None:
        if work is not None:
            work.wait()
        self.finish(key)


class BucketReductions:
    """Starts each bucket's reduction when its last gradient arrives; `sync` off (an accumulation
    micro-step) lets gradients just add up. What a reduction does is the stage's: `collect` puts a
    parameter's gradient where the bucket is reduced from, `start` launches the collective (its
    handle has wait() and is_completed()), `finish` uses its result; `limit`: how many may be in
    flight (None: any number)."""

    def __init__(self, buckets: list[Bucket], collect: Callable[[Bucket, nn.Parameter], None],
                 start: Callable[[Bucket], object], finish: Callable[[Bucket], None], hooked: bool,
                 limit: int | None):
        self.buckets, self.collect, self.start, self.finish, self.limit = buckets, collect, start, finish, limit
        self.sync = True
        self._ready = [0] * len(buckets)
        self._launched = [False] * len(buckets)
        self.in_flight = InFlight(finish, limit)
        # A hook is held by the parameter's C++ side, where Python's collector cannot see the cycle
        # (parameter -> hook -> this -> the buckets -> parameter): removed at close(), or a run
        # inside a longer process would keep its model, its buffers and its process groups.
        self.handles = [p.register_post_accumulate_grad_hook(partial(self._on_grad_ready, bucket))
                        for bucket in buckets for p in bucket.params] if hooked else []

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _on_grad_ready(self, bucket: Bucket, param: nn.Parameter) -> None:
        # Into place on every micro-batch: after the first, autograd adds into the buffer's view,
        # so accumulation holds one copy of the gradients, not autograd's beside the buffer.
        self.collect(bucket, param)
        if not self.sync:
            return  # an accumulation micro-step: nothing is reduced
        self._ready[bucket.index] += 1
        if self._ready[bucket.index] == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        self._launched[bucket.index] = True
        self.in_flight.add(bucket, self.start(bucket))

    def complete(self) -> None:
        """Every bucket reduced: those that got no gradient send their zeros too."""
        for bucket in self.buckets:
            if not self._launched[bucket.index]:
                for param in bucket.params:  # including those no gradient reached (collect is idempotent)
                    self.collect(bucket, param)
                self._launch(bucket)
        self.in_flight.complete_all()
        self._ready = [0] * len(self.buckets)
        self._launched = [False] * len(self.buckets)
