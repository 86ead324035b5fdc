"""What a data-parallel sharding strategy is: the one interface every ZeRO stage answers.

`DataParallel` (strata/parallel/data.py) is composed of one strategy, which owns where the
parameters, gradients and optimizer states live and how gradients are reduced:

  ZeRO-0  `Replicate`             strata/parallel/gradients.py
  ZeRO-1  `ShardOptimizerStates`  strata/parallel/gradients.py
  ZeRO-2  `ShardGradients`        strata/parallel/gradients.py
  ZeRO-3  `ShardParameters`       strata/parallel/zero3.py (ZeRO-Infinity with a tier)
  MoE     `ExpertSplit`           strata/parallel/expert.py: a stage's strategy over the dense
                                  parameters and another over the experts'

Every strategy implements all of `ShardingStrategy`, a no-op or an empty answer where it has
nothing to do, so that callers never ask a strategy what it has (no hasattr/getattr: a test
checks). Its counters are read through one method, `stats()`.

The helpers below are what several strategies compute alike (byte counts, gradient norms, the
optimizer's view of shards)."""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from strata.distributed import comm
from strata.parallel.buckets import Piece

GradPair = tuple[torch.Tensor, nn.Parameter]  # (a gradient or its norm, the parameter it belongs to)
OptimizerPiece = tuple[torch.Tensor, nn.Parameter, int, int]  # (tensor updated, its parameter, flat lo, hi)


@runtime_checkable
class ShardingStrategy(Protocol):
    """One ZeRO stage, as data parallelism, the trainer, the optimizer, checkpoints and the
    metrics use it."""

    stage: int  # the ZeRO stage, 0 to 3
    reduce_every_micro_batch: bool  # no full gradient survives a micro-batch (ZeRO-2/3; ZeRO-2 not under a pipeline)
    # ZeRO-Infinity: gradient shards leave memory as they are reduced, and the strategy sums the
    # tensor-parallel partial gradients then (DataParallel does it for every other one)
    offloaded: bool
    params: list[nn.Parameter]  # the model's trainable parameters it holds
    expert_names: AbstractSet[str]  # names of the expert parameters (empty without a mixture)
    # each dp rank's gradients are its own part of the average (ZeRO-1/2/3), so their norms sum
    # over the dp ranks; ZeRO-0's are the whole average on every rank, as are 1-bit Adam's own
    # whole gradients on a compressed step
    grads_partitioned: bool

    # --- backward -------------------------------------------------------------------------------
    def backward(self, sync: bool, final: bool = True) -> AbstractContextManager[None]:
        """Around one micro-batch's backward: with `sync` its gradients are reduced; `final`: the
        step's last micro-batch."""
        ...

    def reduce_all(self) -> None:
        """Reduce every accumulated gradient at once (after a pipeline schedule)."""
        ...

    def grad_pairs(self) -> list[GradPair]:
        """(this rank's gradient of a parameter, or of its piece; the parameter)."""
        ...

    def grad_norm_pairs(self) -> list[GradPair]:
        """(the norm of each gradient `grad_pairs` lists; the parameter)."""
        ...

    def clip_(self, max_norm: float, total_norm: torch.Tensor) -> None:
        ...

    # --- the update -----------------------------------------------------------------------------
    def optimizer_pieces(self) -> list[OptimizerPiece]:
        """What the optimizer updates, matrices first; a checkpoint saves the same pieces."""
        ...

    def stream_units(self) -> Iterator[list[torch.Tensor]]:
        """The optimizer's tensors in groups, each in memory while it is yielded (ZeRO-Infinity
        reads a unit in and writes it back; in memory: one group of everything)."""
        ...

    def separate_optimizer_targets(self) -> None:
        """Asynchronous pipeline schedules: let the optimizer update tensors other than the
        parameter objects (ZeRO-0; the other stages update such tensors already)."""
        ...

    def prepare_step(self) -> None:
        ...

    def after_step(self) -> None:
        """After the optimizer step and after loading a checkpoint (ZeRO-1/2 start their all-gathers)."""
        ...

    def wait_parameters(self) -> None:
        """Every parameter readable whole now, outside a forward (ZeRO-1/2 wait for their gathers in
        flight; asynchronous schedules stash the updated weights)."""
        ...

    def overlap_gathers(self, units: list[tuple[nn.Module, list[nn.Parameter]]]) -> None:
        """units: (the module each unit's forward enters first, the parameters it reads); ZeRO-1/2
        make that forward wait for those parameters' gathers (the rest stay in flight)."""
        ...

    def zero_grad(self) -> None:
        ...

    # --- what is held, saved and counted ----------------------------------------------------------
    def in_memory(self) -> AbstractContextManager[None]:
        """A context in which every offloaded shard is in memory (a checkpoint reads or writes it)."""
        ...

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The logical model's tensors on this rank (parameters as the fp32 masters)."""
        ...

    def stats(self) -> dict[str, int]:
        """Every counter: `params_bytes` and `grads_bytes` (held in memory now), and, where the
        strategy has them, `peak_buffer_bytes` (ZeRO-2's staging buffers; ZeRO-3's gathered units
        and staged gradients) and `offloaded_bytes` (what ZeRO-Infinity's tier holds)."""
        ...

    def close(self) -> None:
        """Release the gradient hooks (and a tier's files)."""
        ...


# --- what several strategies compute alike ------------------------------------------------------
def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def norm_pairs(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's L2 norm (one kernel per dtype); every stage takes them the same way, so an
    offloaded run that takes them a unit at a time gets the same bits."""
    return list(torch._foreach_norm(grads)) if grads else []


def pair_norms(pairs: list[GradPair]) -> list[GradPair]:
    """(gradient, parameter) pairs -> (the gradient's norm, parameter)."""
    return list(zip(norm_pairs([g for g, _ in pairs]), (p for _, p in pairs)))


def gather_shards(shard: torch.Tensor, size: int, group, group_name: str = "dp") -> torch.Tensor:
    """Every rank's equal shard of a flat tensor of `size` elements, all-gathered into a new one."""
    flat = shard.new_empty(size)
    comm.all_gather(flat, shard, group, group_name)
    return flat


def sharded_optimizer_pieces(pieces: list[Piece], shard_params: list[torch.Tensor]) -> list[OptimizerPiece]:
    """(shard, the parameter it is part of, its flat range in it): what decays first."""
    pairs = list(zip(shard_params, pieces))
    ordered = [x for x in pairs if x[1].decays] + [x for x in pairs if not x[1].decays]
    return [(shard, pc.param, pc.start - pc.offset, pc.end - pc.offset) for shard, pc in ordered]
