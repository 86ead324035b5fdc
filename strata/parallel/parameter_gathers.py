"""ZeRO-1/2's all-gathers of the updated parameter shards, overlapped with the next forward.

After the optimizer step every bucket's gather starts, the first layers' buckets (the flat
buffer's last: it is laid out back to front) first, and none is waited for there. Each unit of the
model (the inputs, a block, the outputs) waits, as its forward begins, for the gathers of the
buckets holding its parameters, and no others: the rest run behind its compute, as Megatron's
distributed optimizer overlaps its parameter gathers with the forward. Whatever reads whole
parameters outside a forward (a checkpoint, the optimizer's next step, closing) waits for all."""

from __future__ import annotations

from torch import nn

from strata.distributed import comm
from strata.parallel.buckets import Bucket


class ParameterGathers:
    def __init__(self, buckets: list[Bucket]):
        self.buckets = buckets
        self.in_flight: dict[int, comm._Pending] = {}  # bucket index -> its all-gather
        self.hooks: list = []

    def started(self, bucket: Bucket, work: comm._Pending) -> None:
        self.in_flight[bucket.index] = work

    def watch(self, units: list[tuple[nn.Module, list[nn.Parameter]]]) -> None:
        """units: (the module a unit's forward enters first, the parameters the unit reads). That
        module's forward waits for the gathers of the buckets holding them, and no others."""
        bucket_of = {id(p): bucket.index for bucket in self.buckets for p in bucket.params}
        for module, params in units:
            indices = sorted({bucket_of[id(p)] for p in params if id(p) in bucket_of})
            if indices:
                self.hooks.append(module.register_forward_pre_hook(
                    lambda _module, _args, indices=indices: self.wait(indices)))

    def wait(self, indices: list[int] | None = None) -> None:
        """Wait for the gathers of these buckets in flight (None: all of them)."""
        for index in list(self.in_flight) if indices is None else indices:
            work = self.in_flight.pop(index, None)
            if work is not None:
                work.wait()

    def close(self) -> None:
        self.wait()
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
