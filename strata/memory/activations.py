"""Counting the activation memory autograd keeps for backward, with saved-tensor hooks.

Every tensor an operation saves passes through a pack hook; the same storage saved by several
operations (the normed input of q, k and v) is counted once, and parameters and buffers are
model states, not activations, so they are left out (ZeRO-3's gathered parameters too: they are
freed after the forward and gathered again for the backward, so autograd's references hold none).

Saved-tensor hooks do not nest: inside a model that installs its own (sequence parallelism keeps
gathered inputs as their local shard), the innermost pack hook sees every tensor. Such a hook calls
`observe(tensor)` for what it actually keeps, so an active counter still sees everything once."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

_counters: list["SavedActivations"] = []


class SavedActivations:
    def __init__(self):
        self.active = True  # a caller may count only part of a forward (one layer)
        self.bytes = 0
        self._seen: set[tuple[int, int]] = set()
        self._excluded: set[int] = set()

    def exclude(self, module: nn.Module) -> None:
        # by the storage itself, not its address: ZeRO-3's parameters are views into a unit's flat
        # storage that is freed (resized to 0) after use and allocated again at each gather
        self._excluded |= {t.untyped_storage()._cdata for t in (*module.parameters(), *module.buffers())
                           if t.device.type != "meta"}

    def add(self, tensor: torch.Tensor) -> None:
        if not self.active:
            return
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if storage._cdata not in self._excluded and key not in self._seen:
            self._seen.add(key)
            self.bytes += storage.nbytes()


def observe(tensor: torch.Tensor) -> None:
    """Report a tensor kept for backward to every active counter."""
    for counter in _counters:
        counter.add(tensor)


def _pack(tensor: torch.Tensor) -> torch.Tensor:
    observe(tensor)
    return tensor


@contextmanager
def count_saved_activations(*exclude: nn.Module):
    """with count_saved_activations(model) as saved: loss = model(x, y)  ->  saved.bytes"""
    saved = SavedActivations()
    for module in exclude:
        saved.exclude(module)
    _counters.append(saved)
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, lambda tensor: tensor):
            yield saved
    finally:
        _counters.remove(saved)
