"""Counting the bytes of the tensors a piece of code allocates and keeps alive, and their peak, on
any device (the CPU has no allocator statistics to read):

    with LiveBytes() as counted:
        model(x, y).backward()
    counted.peak, counted.live   # the most alive at once, and what is still alive

A torch dispatch mode sees each aten call of this thread, forward and backward; each output's
storage not seen before is an allocation, counted until the storage is freed (a finalizer on the
storage object, which lives exactly as long as the storage). Storages that existed before (the
inputs, the parameters), and views of them, are not counted. What a kernel allocates and frees
inside one call is not seen: the count is of tensors, not of the allocator's bytes."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages allocated under it that are alive (`live`), and the most at once
    (`peak`)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._counted: set[int] = set()  # storages allocated here and alive, by their C++ object
        self._earlier: set[int] = set()  # storages from before, met as inputs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for tensor in _tensors((args, kwargs)):
            self._note(tensor, self._earlier, count=False)
        out = func(*args, **kwargs)
        for tensor in _tensors(out):
            self._note(tensor, self._counted, count=True)
        return out

    def _note(self, tensor: torch.Tensor, into: set[int], count: bool) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._counted or key in self._earlier:
            return
        into.add(key)
        nbytes = storage.nbytes() if count else 0
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, into, key, nbytes)

    def _freed(self, into: set[int], key: int, nbytes: int) -> None:
        into.discard(key)  # the address may be reused by a later storage
        self.live -= nbytes


def _tensors(tree) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]
