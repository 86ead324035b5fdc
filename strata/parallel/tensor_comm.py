"""The communication of tensor parallelism as autograd functions (Megatron-LM's "conjugate"
operators, Shoeybi et al. 2019, Fig. 3; Korthikanti et al. 2022 for the sequence-parallel pair).

  copy_to_tp       forward: identity            backward: all-reduce        ("f")
  reduce_from_tp   forward: all-reduce          backward: identity          ("g")
  gather_seq       forward: all-gather on seq   backward: reduce-scatter    (sequence parallel)
  scatter_seq      forward: reduce-scatter      backward: all-gather        (sequence parallel)
  split_seq        forward: keep this rank's    backward: all-gather
                   slice of the sequence

Sequences are dimension 1 of (batch, seq, hidden); collectives work on dimension 0, so the
sequence is moved to the front and back. Every call goes through strata.distributed.comm, which
counts the bytes under the group name "tp". Compiled blocks (--compile) call them as they are:
torch.compile leaves them out of its graphs."""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.distributed as dist

from strata.distributed import comm
from strata.memory.activations import observe

GROUP = "tp"


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    comm.all_reduce(x, group, GROUP)
    return x


def _gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    local = x.transpose(0, 1).contiguous()
    out = local.new_empty((local.shape[0] * world, *local.shape[1:]))
    comm.all_gather(out, local, group, GROUP)
    # contiguous (batch, seq, hidden): the linear layers reading it save views of this storage,
    # which is what lets SequenceParallelSaver recognise them
    return out.transpose(0, 1).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    full = x.transpose(0, 1).contiguous()
    out = full.new_empty((full.shape[0] // world, *full.shape[1:]))
    comm.reduce_scatter(out, full, group, GROUP)
    return out.transpose(0, 1)


def _split_seq(x: torch.Tensor, group) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(world, dim=1)[rank].contiguous()


def conjugate(name: str, forward, backward):
    """An autograd function that runs `forward(x, group)` and, on the gradient, `backward(grad,
    group)`; `group` is whatever the two understand (a process group here, a grid axis in
    tensor_nd.py). Left out of torch.compile's graphs."""
    def fwd(ctx, x, group):
        ctx.group = group
        return forward(x, group)

    def bwd(ctx, grad):
        return backward(grad, ctx.group), None

    op = type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})
    return torch.compiler.disable(op.apply)


def _identity(x, group):
    return x


def _scale(x, factor):
    return x * factor


copy_to_tp = conjugate("CopyToTP", _identity, _all_reduce)
# identity forward, the gradient times `factor` (the group argument): a replicated layer's input
# gradient, computed alike on every rank, counted once by the all-reduce that follows
scale_gradient = conjugate("ScaleGradient", _identity, _scale)
reduce_from_tp = conjugate("ReduceFromTP", _all_reduce, _identity)
scatter_seq = conjugate("ScatterSeq", _reduce_scatter_seq, _gather_seq)
split_seq = conjugate("SplitSeq", _split_seq, _gather_seq)


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, saver):
        ctx.group = group
        full = _gather_seq(x, group)
        if saver is not None:
            saver.note(full, x)
        return full

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None, None


@torch.compiler.disable
def gather_seq(x, group, saver: "SequenceParallelSaver | None" = None):
    return _GatherSeq.apply(x, group, saver)


class SequenceParallelSaver:
    """Saved-tensor hooks for sequence parallelism (Korthikanti et al. 2022, section 4.2.2): the
    all-gathered input of a column-parallel group is not kept for backward; its local 1/t shard
    is, and backward gathers it again (one more all-gather per group, in backward), so that every
    activation between the blocks takes 1/t of the memory.

    Active during the model's forward (its pack hook) and backward (its unpack hook)."""

    def __init__(self, group):
        self.group = group
        # id(gathered tensor) -> (weak reference to it, its number, the local shard). Matched by
        # object identity, not by storage address: a freed tensor's address is soon reused.
        self._shards: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}
        self._uses: dict[int, int] = {}  # id -> unpacks still to come
        self._regathered: dict[int, torch.Tensor] = {}
        self._ids = itertools.count()

    def note(self, full: torch.Tensor, local: torch.Tensor) -> None:
        self._shards[id(full)] = (weakref.ref(full), next(self._ids), local.detach())

    def end_forward(self) -> None:
        self._shards.clear()

    def pack(self, tensor: torch.Tensor):
        base = tensor._base if tensor._base is not None else tensor  # a view's root tensor
        found = self._shards.get(id(base))
        if found is None or found[0]() is not base:
            observe(tensor)
            return tensor
        _, uid, local = found
        observe(local)
        self._uses[uid] = self._uses.get(uid, 0) + 1
        return (uid, local, tensor.shape, tensor.stride(), tensor.storage_offset())

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        uid, local, shape, stride, offset = packed
        if uid not in self._regathered:
            self._regathered[uid] = _gather_seq(local, self.group)
        full = self._regathered[uid]
        self._uses[uid] -= 1
        if self._uses[uid] == 0:  # q, k and v have all had it: let it go
            del self._uses[uid], self._regathered[uid]
        return full.as_strided(shape, stride, offset)
