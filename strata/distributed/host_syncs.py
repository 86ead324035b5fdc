"""Counting the points where the host waits for the device (issue 53): the operations whose result
the host must read before it can go on. On a GPU each one drains the stream and leaves the device
idle while Python catches up; on a CPU they cost nothing, so they are counted, not timed.

    with HostSyncs() as syncs:
        train_step(run, step)
    syncs.count, syncs.by_kind   # e.g. 2, {"item": 2}

Counted, on every device (a torch dispatch mode sees each aten call of this thread, forward and
backward): `.item()`, `bool(t)`, `int(t)`, `float(t)` (aten's _local_scalar_dense), `.tolist()`,
`nonzero` and what calls it (boolean-mask indexing, `masked_select`), the ops whose output size
depends on values (`repeat_interleave` without `output_size`, `unique`, `bincount`),
`torch.cuda.synchronize`, and a copy from pageable host memory to a device (which the host waits
out; from pinned memory with non_blocking it does not). On CUDA, `torch.cuda.set_sync_debug_mode`
is the device's own count: bench/gpu_check.py reads both."""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# Ops whose output the host must read (or whose output's size depends on values it must read).
_READS = {aten._local_scalar_dense.default: "item", aten.nonzero.default: "nonzero",
          aten.masked_select.default: "masked_select", aten.unique_dim.default: "unique",
          aten._unique2.default: "unique", aten.bincount.default: "bincount",
          aten.repeat_interleave.Tensor: "repeat_interleave"}
_COPIES = {aten._to_copy.default, aten.copy_.default}


class HostSyncs(TorchDispatchMode):
    """A count of host syncs by kind, while the block runs (this thread's operations)."""

    def __init__(self):
        super().__init__()
        self.by_kind: collections.Counter = collections.Counter()
        self._patched = []

    @property
    def count(self) -> int:
        return sum(self.by_kind.values())

    def __enter__(self):
        for owner, name, kind in ((torch.Tensor, "tolist", "tolist"), (torch.cuda, "synchronize", "synchronize")):
            original = getattr(owner, name)
            setattr(owner, name, self._counting(original, kind))
            self._patched.append((owner, name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()
        return super().__exit__(*exc)

    def _counting(self, original, kind: str):
        def counted(*args, **kwargs):
            self.by_kind[kind] += 1
            return original(*args, **kwargs)
        return counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _READS.get(func)
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None:
            kind = None  # told its size: no read
        if func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            kind = "boolean index"
        if func in _COPIES and _pageable_upload(func, args, kwargs):
            kind = "pageable copy"
        if kind is not None:
            self.by_kind[kind] += 1
        return func(*args, **kwargs)


def _pageable_upload(func, args, kwargs) -> bool:
    """A copy from host memory that is not pinned onto an accelerator."""
    if func is aten._to_copy.default:
        source, device = args[0], kwargs.get("device")
    else:
        source, device = args[1], args[0].device
    if device is None or torch.device(device).type == "cpu" or source.device.type != "cpu":
        return False
    return not source.is_pinned()
