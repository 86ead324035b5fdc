"""Flat buffers cut into buckets: the data structure data parallelism and ZeRO share.

Parameters are laid out back to front (the order backward produces their gradients), so the first
bucket fills first and its reduction can start while backward computes the rest. A parameter never
straddles two buckets; each bucket is padded to a multiple of the data-parallel size so that it
splits into equal shards, rank r owning shard r of every bucket. ZeRO-0/1/2's buffers are aligned
(each parameter, bucket and shard starts on a boundary NCCL and the fused optimizer prefer:
strata/rules/buckets.py); the gaps are padding, zero in every buffer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from strata.distributed import comm
from strata.rules import buckets as buckets_rule


@dataclass
class Bucket:
    index: int
    start: int  # first element in the flat buffer
    size: int  # elements, padded to a multiple of the dp size (aligned: rules/buckets.bucket_multiple)
    params: list[nn.Parameter] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # of each parameter in the flat buffer

    def shard(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """This rank's [start, end) of the flat buffer within the bucket."""
        shard_size = self.size // dp_size
        return self.start + dp_rank * shard_size, self.start + (dp_rank + 1) * shard_size


@dataclass
class Piece:
    """The part of one parameter that falls in this rank's shard: flat buffer range [start, end),
    which is [start - offset, end - offset) of the parameter's own flattened elements."""
    param: nn.Parameter
    start: int
    end: int
    offset: int
    shard_index: int  # where the piece starts in this rank's shards laid end to end

    @property
    def decays(self) -> bool:
        return self.param.dim() >= 2  # weight decay on matrices and embeddings only


def plan_buckets(params: list[nn.Parameter], bucket_elems: int, dp_size: int,
                 aligned: bool = False) -> tuple[list[Bucket], int]:
    """Group `params` (in the order given) into buckets of about bucket_elems elements (the cut:
    strata/rules/buckets.py, which the planner counts collectives with); aligned for ZeRO-0/1/2's
    buffers, packed (the default) for ZeRO-3's units."""
    plans = buckets_rule.plan_buckets([p.numel() for p in params], bucket_elems, dp_size, aligned)
    buckets = [Bucket(index, plan.start, plan.size, [params[i] for i in plan.members], list(plan.offsets))
               for index, plan in enumerate(plans)]
    return buckets, buckets[-1].start + buckets[-1].size


def shard_pieces(buckets: list[Bucket], dp_rank: int, dp_size: int) -> list[Piece]:
    """Every (parameter, range) this rank owns, bucket by bucket."""
    pieces = []
    for bucket in buckets:
        lo, hi = bucket.shard(dp_rank, dp_size)
        for p, offset in zip(bucket.params, bucket.offsets):
            start, end = max(lo, offset), min(hi, offset + p.numel())
            if start < end:
                pieces.append(Piece(p, start, end, offset, bucket.start // dp_size + start - lo))
    return pieces


def bucket_elements(bucket_mb: float, dtype: torch.dtype) -> int:
    return buckets_rule.bucket_elements(bucket_mb, torch.tensor([], dtype=dtype).element_size())


def flat_parameters(buckets: list[Bucket], total: int, sample: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Move the parameters into one flat buffer of `dtype`, one at a time (each original is freed
    as its .data is replaced, so the model is never held twice); padding (the alignment's gaps
    before parameters, each bucket's tail) zeroed."""
    buffer = torch.empty(total, dtype=dtype, device=sample.device)
    for bucket in buckets:
        end = bucket.start
        for p, offset in zip(bucket.params, bucket.offsets):
            buffer[end:offset].zero_()
            view = buffer[offset:offset + p.numel()]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)
            end = offset + p.numel()
        buffer[end:bucket.start + bucket.size].zero_()
    return buffer


@torch.no_grad()
def broadcast_parameters(buckets: list[Bucket], group, group_name: str = "dp") -> None:
    """Copy rank 0's parameters to every rank of the group, so all replicas start identical; one
    broadcast per bucket, through a buffer of one bucket's size."""
    for bucket in buckets:
        flat = torch.cat([p.detach().reshape(-1) for p in bucket.params])
        comm.broadcast(flat, 0, group, group_name)
        for p, piece in zip(bucket.params, flat.split([p.numel() for p in bucket.params])):
            p.copy_(piece.view_as(p))


class GradientBuffer:
    """One flat gradient buffer that buckets are reduced from, each parameter's gradient a view into
    it once collected. A step starts with no gradients (`release`): autograd hands backward's
    gradient over without a copy, the first micro-batch's hook copies it into the buffer (one read
    and one write: cheaper than zeroing the buffer every step and adding into it), and the view
    becomes `.grad`: later micro-batches add into it in place, and the reduction, clipping and
    the optimizer read it."""

    def __init__(self, buckets: list[Bucket], total: int, sample: torch.Tensor):
        self.flat = torch.zeros(total, dtype=sample.dtype, device=sample.device)  # padding stays zero
        self.views = {p: self.flat[offset:offset + p.numel()].view_as(p)
                      for bucket in buckets for p, offset in zip(bucket.params, bucket.offsets)}
        self.release()

    def collect(self, bucket: Bucket, param: nn.Parameter) -> None:
        """Make sure the buffer holds `param`'s gradient (zeros when none reached it); idempotent."""
        view = self.views[param]
        if param.grad is None:
            view.zero_()
        elif param.grad is not view:
            view.copy_(param.grad)
        param.grad = view

    def release(self) -> None:
        for param in self.views:
            param.grad = None
