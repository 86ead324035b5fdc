"""Bucket reductions: what ZeRO-0/1/2 (strata/parallel/gradients.py) share to overlap gradient
communication with backward (Li et al., "PyTorch Distributed", VLDB 2020). Each bucket's arriving
gradients are counted by post-accumulate-grad hooks and its collective starts when the last one is
in, with at most MAX_IN_FLIGHT collectives outstanding; the stage says what a reduction does."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import nn

from strata.parallel.buckets import Bucket
from strata.rules.constants import MAX_IN_FLIGHT


class BucketReductions:
    """Starts each bucket's reduction when its last gradient arrives; `sync` off (an accumulation
    micro-step) lets gradients just add up. What a reduction does is the stage's: `collect` puts a
    parameter's gradient where the bucket is reduced from, `start` launches the collective,
    `finish` uses its result."""

    def __init__(self, buckets: list[Bucket], collect: Callable[[Bucket, nn.Parameter], None],
                 start: Callable[[Bucket], object], finish: Callable[[Bucket], None], hooked: bool):
        self.buckets, self.collect, self.start, self.finish = buckets, collect, start, finish
        self.sync = True
        self._ready = [0] * len(buckets)
        self._launched = [False] * len(buckets)
        self._pending: list = []
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
        self._pending.append((bucket, self.start(bucket)))
        while len(self._pending) > MAX_IN_FLIGHT:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        bucket, work = self._pending.pop(0)
        work.wait()
        self.finish(bucket)

    def complete(self) -> None:
        """Every bucket reduced: those that got no gradient send their zeros too."""
        for bucket in self.buckets:
            if not self._launched[bucket.index]:
                for param in bucket.params:  # including those no gradient reached (collect is idempotent)
                    self.collect(bucket, param)
                self._launch(bucket)
        while self._pending:
            self._complete_oldest()
        self._ready = [0] * len(self.buckets)
        self._launched = [False] * len(self.buckets)
