"""Flat buffers cut into buckets: the data structure data parallelism and ZeRO share.

Parameters are laid out back to front (the order backward produces their gradients), so the first
bucket fills first and its reduction can start while backward computes the rest. A parameter never
straddles two buckets; each bucket is padded to a multiple of the data-parallel size so that it
splits into equal shards, rank r owning shard r of every bucket."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Bucket:
    index: int
    start: int  # first element in the flat buffer
    size: int  # elements, padded to a multiple of the dp size
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


def plan_buckets(params: list[nn.Parameter], bucket_elems: int, dp_size: int) -> tuple[list[Bucket], int]:
    """Group `params` (in the order given) into buckets of about bucket_elems elements."""
    buckets: list[Bucket] = []
    current = Bucket(0, 0, 0)
    for p in params:
        if current.params and current.size + p.numel() > bucket_elems:
            buckets.append(_close(current, dp_size))
            current = Bucket(len(buckets), buckets[-1].start + buckets[-1].size, 0)
        current.params.append(p)
        current.offsets.append(current.start + current.size)
        current.size += p.numel()
    buckets.append(_close(current, dp_size))
    return buckets, buckets[-1].start + buckets[-1].size


def _close(bucket: Bucket, dp_size: int) -> Bucket:
    bucket.size = -(-bucket.size // dp_size) * dp_size
    return bucket


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
    return max(1, int(bucket_mb * 2**20 / torch.tensor([], dtype=dtype).element_size()))
