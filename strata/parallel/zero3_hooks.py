"""ZeRO-3's hooks: when units are gathered, freed and their gradients reduce-scattered
(strata/parallel/zero3.py has the strategy as a whole, zero3_units.py the gathering itself).

  forward:  a unit's pre-hook gathers it (prefetched while the unit before ran) and prefetches the
            next; its last module's hook frees it (a tied embedding's unit is kept: the head reads
            its matrix last), under hpZ keeping this rank's 1/K of it for the backward's gather
  backward: a unit's pre-hook gathers it again and prefetches the previous one; each parameter's
            post-accumulate-grad hook stages its gradient in the unit's flat staging buffer, and
            the last one reduce-scatters the buffer and frees the unit

At most MAX_IN_FLIGHT reduce-scatters are outstanding, which bounds the full gradients alive at
once; those already done are retired first, so backward waits only while more are still running
(the buckets' queue, bucket_reductions.InFlight); a completed one hands this rank's reduced shard to `receive` (the strategy: added to the
gradient shard in memory, or sent to ZeRO-Infinity's tier).

Under a pipeline the schedule interleaves micro-batches and chunks: with reshard_after_forward (the
default) a unit is gathered and reduce-scattered as above for each micro-batch, its arrivals counted
afresh after each reduce-scatter; without it (keep_gathered) every unit stays gathered from its first
use to the schedule's end, each micro-batch's gradients are added into its staging, and
`finish_backward` reduce-scatters each unit once."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from strata.distributed import comm
from strata.parallel.bucket_reductions import InFlight
from strata.parallel.zero3_units import Unit, UnitGathers
from strata.rules.constants import MAX_IN_FLIGHT


class UnitHooks:
    """The module and gradient hooks over every unit, and the reduce-scatters they start."""

    def __init__(self, model: nn.Module, gathers: UnitGathers, settings,
                 receive: Callable[[Unit, torch.Tensor], None]):
        self.gathers, self.units, self.settings, self.receive = gathers, gathers.units, settings, receive
        self.group, self.dp_size, self.dp_rank = settings.dp_group, settings.dp_size, settings.dp_rank
        self.offload = gathers.offload
        self.keep_gathered = settings.keep_gathered and settings.pp_group is not None
        # (unit, its reduce-scatter or None on one process), oldest first
        self.in_flight = InFlight(self._received, MAX_IN_FLIGHT)
        # held by the parameters' C++ side: removed at remove() (see BucketReductions)
        self.grad_hooks: list = []
        for unit in self.units:
            self._register(unit)
        model.register_forward_hook(self._after_model_forward)

    def _register(self, unit: Unit) -> None:
        for module in unit.modules:
            module.register_forward_pre_hook(partial(self._before_forward, unit))
            module.register_full_backward_pre_hook(partial(self._before_backward, unit))
        unit.modules[-1].register_forward_hook(partial(self._after_forward, unit))
        self.grad_hooks += [param.register_post_accumulate_grad_hook(partial(self._on_grad_ready, unit))
                            for param in unit.bucket.params]

    def remove(self) -> None:
        for handle in self.grad_hooks:
            handle.remove()
        self.grad_hooks = []

    # --- prefetch ---------------------------------------------------------------------------------
    def _prefetch(self, index: int, direction: int) -> None:
        """Start gathering the unit computed next; offloaded, start reading its shard and the
        next one's (read-ahead), and on one process gather it only if its read has landed, so
        compute does not wait here (with data parallelism the gather is issued now regardless:
        the ranks' collectives must come in the same order)."""
        if not 0 <= index < len(self.units):
            return
        unit = self.units[index]
        if self.offload is None:
            self.gathers.gather(unit)
            return
        if not (unit.gathered or unit.pending_gather is not None):
            self.offload.fetch_shard(index)
            # every rank must issue its collectives in one order, whatever its disk's timing
            if self.offload.shard_landed(index) or self.group is not None:
                self.gathers.gather(unit)
        if 0 <= index + direction < len(self.units) and not self.units[index + direction].gathered:
            self.offload.fetch_shard(index + direction)

    # --- forward ----------------------------------------------------------------------------------
    def _before_forward(self, unit: Unit, module, args) -> None:
        for read in unit.reads:
            self.gathers.ensure_gathered(read)
        self.gathers.ensure_gathered(unit)
        self._prefetch(unit.index + 1, 1)

    def _after_forward(self, unit: Unit, module, args, output) -> None:
        if not unit.keep_after_forward:
            self.gathers.free(unit, keep_secondary=torch.is_grad_enabled())  # hpZ: a backward will follow

    def _after_model_forward(self, module, args, output) -> None:
        if not torch.is_grad_enabled():  # no backward will come to free the kept units
            for unit in self.units:
                if unit.gathered:
                    self.gathers.free(unit)

    # --- backward ---------------------------------------------------------------------------------
    def _before_backward(self, unit: Unit, module, grad_output) -> None:
        for read in unit.reads:
            self.gathers.ensure_gathered(read)
        self.gathers.ensure_gathered(unit)
        self._prefetch(unit.index - 1, -1)

    def _new_staging(self, unit: Unit) -> torch.Tensor:
        """A zeroed full gradient, in the dtype it travels in."""
        return unit.shard.new_zeros(unit.bucket.size, dtype=self.settings.reduce_dtype or unit.shard.dtype)

    def _on_grad_ready(self, unit: Unit, param: nn.Parameter) -> None:
        if unit.staging is None:
            unit.staging = self._new_staging(unit)
            self.gathers.count_buffers()
        offset = unit.offset_of[id(param)]
        target = unit.staging[offset:offset + param.numel()]
        if self.keep_gathered:  # every micro-batch's gradient added up, reduced once by finish_backward
            target.add_(param.grad.reshape(-1))
            param.grad = None
            return
        target.copy_(param.grad.reshape(-1))
        param.grad = None
        unit.ready += 1
        if unit.ready == len(unit.bucket.params):
            self._reduce(unit)
            if not unit.keep_through_step:
                self.gathers.free(unit)

    def _reduce(self, unit: Unit) -> None:
        # no gradient reached this unit: reduce zeros
        staging = unit.staging if unit.staging is not None else self._new_staging(unit)
        lo, hi = unit.bucket.shard(self.dp_rank, self.dp_size)
        work = None if self.group is None else comm.reduce_scatter(staging[lo:hi], staging, self.group,
                                                                    self.settings.group_name, async_op=True)
        # the next micro-batch of a pipeline stages into a new buffer while this one is reduced
        unit.staging, unit.ready, unit.reduced = None, 0, True
        unit.reducing.append(staging)
        self.in_flight.add((unit, staging), work)  # bounds the full gradients alive at once

    def _received(self, key: tuple[Unit, torch.Tensor]) -> None:
        unit, staging = key
        lo, hi = unit.bucket.shard(self.dp_rank, self.dp_size)
        unit.reducing = [s for s in unit.reducing if s is not staging]
        self.receive(unit, staging[lo:hi])

    def finish_backward(self) -> None:
        """After a micro-batch's backward (or a pipeline's schedule): reduce the units no gradient
        completed (with keep_gathered, every unit, once), wait for every reduce-scatter, free what
        is still gathered."""
        for unit in self.units:
            if not unit.reduced or unit.staging is not None:
                self._reduce(unit)
        self.in_flight.complete_all()
        for unit in self.units:
            unit.reduced = False
            if unit.gathered:
                self.gathers.free(unit)
        self.gathers.drop_secondaries()  # hpZ: those no backward gathered
