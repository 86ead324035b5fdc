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
counts the bytes under the group name "tp"."""

from __future__ import annotations

import torch
import torch.distributed as dist

from strata.distributed import comm

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
    return out.transpose(0, 1)


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    full = x.transpose(0, 1).contiguous()
    out = full.new_empty((full.shape[0] // world, *full.shape[1:]))
    comm.reduce_scatter(out, full, group, GROUP)
    return out.transpose(0, 1)


def _split_seq(x: torch.Tensor, group) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(world, dim=1)[rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


class _SplitSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


def copy_to_tp(x, group):
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return _ReduceFromTP.apply(x, group)


def gather_seq(x, group):
    return _GatherSeq.apply(x, group)


def scatter_seq(x, group):
    return _ScatterSeq.apply(x, group)


def split_seq(x, group):
    return _SplitSeq.apply(x, group)
