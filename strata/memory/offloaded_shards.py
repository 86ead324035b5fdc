"""ZeRO-Infinity's parameter tier (Rajbhandari et al. 2021; `--offload-params cpu|disk`): where
ZeRO-3's shards and their gradient shards live between uses, one pair per unit.

ZeRO-3 (strata/parallel/zero3.py) is given an `OffloadedShards` built on a tier (tiers.py) and asks
it for a unit's tensors when it needs them: a shard is read in (in the background, one unit ahead)
before its gather and dropped once gathered, since the tier's copy is current and only the
optimizer changes it; a gradient shard is written after each reduce-scatter and read back only when
an earlier micro-batch of the step left one (else it is made as zeros); the optimizer's pass reads
a unit's shard and gradient, and writes the updated shard back. The tensor objects stay the same
throughout: an offloaded one has a storage of zero bytes (tiers.py), so views of it stay valid."""

from __future__ import annotations

from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from strata.memory import tiers
from strata.memory.tiers import Tier


@dataclass
class _UnitShards:
    """One unit's shard and gradient shard, the reads in flight and what is in memory."""
    shard: torch.Tensor
    grad: torch.Tensor
    shard_read: Future | None = None
    grad_read: Future | None = None
    shard_here: bool = False  # in memory, or on its way there (a read is queued)
    grad_here: bool = False
    grad_zero: bool = True  # nothing written to the tier this step: the gradient is zeros


class OffloadedShards:
    """A tier holding each unit's shard and gradient shard, keyed by the unit's index."""

    def __init__(self, tier: Tier):
        self.tier = tier
        self.units: dict[int, _UnitShards] = {}
        self.pinned = False  # `in_memory()`: every shard held

    def add(self, index: int, shard: torch.Tensor, grad: torch.Tensor) -> None:
        """Room for a unit's shard (written now, it holds the initial values) and its gradient;
        both leave memory."""
        self.tier.reserve(f"shard{index}", shard)
        self.tier.reserve(f"grad{index}", grad)
        self.tier.evict(f"shard{index}", shard, dirty=True)
        self.tier.evict(f"grad{index}", grad, dirty=False)
        self.units[index] = _UnitShards(shard, grad)

    # --- shards -----------------------------------------------------------------------------------
    def fetch_shard(self, index: int) -> None:
        """Start reading a shard back, unless it is in memory or on its way."""
        unit = self.units[index]
        if not unit.shard_here:
            unit.shard_read = self.tier.fetch(f"shard{index}", unit.shard)
            unit.shard_here = True

    def shard_landed(self, index: int) -> bool:
        """Whether the shard's read (if one was started) is done: using it would not block the host
        (on an accelerator: its copy is queued on the tier's copy stream, which compute then waits for)."""
        read = self.units[index].shard_read
        return read is None or read.done()

    def load_shard(self, index: int) -> None:
        """The shard in memory now."""
        self.fetch_shard(index)
        unit = self.units[index]
        tiers.wait(unit.shard_read)
        unit.shard_read = None

    def drop_shard(self, index: int, dirty: bool = False) -> None:
        """Free a shard's memory (the tier's copy is current unless `dirty`); held while pinned."""
        unit = self.units[index]
        if not self.pinned and unit.shard_here:
            self.tier.evict(f"shard{index}", unit.shard, dirty)
            unit.shard_here = False

    # --- gradient shards --------------------------------------------------------------------------
    def grad_is_zero(self, index: int) -> bool:
        return self.units[index].grad_zero

    def fetch_grad(self, index: int) -> None:
        """Start bringing the gradient shard into memory: zeros when the tier holds none this step."""
        unit = self.units[index]
        if unit.grad_here:
            return
        unit.grad_read = self.tier.zeros(unit.grad) if unit.grad_zero else self.tier.fetch(f"grad{index}", unit.grad)
        unit.grad_here = True

    def load_grad(self, index: int) -> None:
        """The gradient shard in memory now."""
        self.fetch_grad(index)
        unit = self.units[index]
        tiers.wait(unit.grad_read)
        unit.grad_read = None

    def write_grad(self, index: int, grad: torch.Tensor) -> None:
        """Store the unit's gradient shard (`grad`: its contents, in memory or a tensor of its own)."""
        self.tier.write(f"grad{index}", grad)
        self.units[index].grad_zero = False

    def drop_grad(self, index: int) -> None:
        """Free the gradient shard's memory (written already, or about to be zeroed)."""
        unit = self.units[index]
        self.tier.evict(f"grad{index}", unit.grad, dirty=False)
        unit.grad_here = False

    def zero_grads(self) -> None:
        """A new step: nothing to write, the next gradients are added to zeros made then."""
        for unit in self.units.values():
            unit.grad_zero = True

    # --- the optimizer's pass and checkpoints -----------------------------------------------------
    def read_ahead(self, index: int) -> None:
        """Start reading a unit's shard and gradient shard."""
        self.fetch_shard(index)
        self.fetch_grad(index)

    def wait_reads(self, index: int) -> None:
        """A unit's shard and gradient shard in memory now (their reads started by `read_ahead`)."""
        unit = self.units[index]
        tiers.wait(unit.shard_read)
        unit.shard_read = None
        tiers.wait(unit.grad_read)
        unit.grad_read = None

    @contextmanager
    def in_memory(self):
        """Every shard read into memory and held; written back and freed after."""
        for index in self.units:
            self.load_shard(index)
        self.pinned = True
        try:
            yield
        finally:
            self.pinned = False
            for index in self.units:
                self.drop_shard(index, dirty=True)

    # --- accounting -------------------------------------------------------------------------------
    def held_bytes(self) -> tuple[int, int]:
        """(shard bytes, gradient bytes) in memory now: those read in or on their way in (an
        eviction counts as done when it is queued)."""
        def size(tensor: torch.Tensor) -> int:
            return tensor.numel() * tensor.element_size()
        return (sum(size(u.shard) for u in self.units.values() if u.shard_here),
                sum(size(u.grad) for u in self.units.values() if u.grad_here))

    def bytes_held(self) -> int:
        """What the tier holds: the shards and their gradients."""
        return self.tier.bytes_held()

    def close(self) -> None:
        self.tier.close()
