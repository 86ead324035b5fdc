"""How gradients are cut into buckets (--bucket-mb): the rule the runtime lays its flat buffers out
by (strata/parallel/buckets.py) and the planner counts data parallelism's collectives with
(strata/plan/data_parallel.py), one collective per bucket.

Parameters are taken in the order given (the runtime gives them back to front, the order backward
produces their gradients) and added to the current bucket until the next one would take it past
the bucket's elements; a parameter never straddles two buckets, so one larger than a bucket has a
bucket of its own, and so has a small one between two such. Each bucket is padded to a multiple of
the data-parallel size so that it splits into equal shards."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BucketPlan:
    start: int  # first element in the flat buffer
    size: int  # elements, padded to a multiple of the dp size
    members: tuple[int, ...]  # indices of its parameters in the order given
    offsets: tuple[int, ...]  # of each member in the flat buffer


def bucket_elements(bucket_mb: float, element_bytes: int) -> int:
    """Elements of a --bucket-mb bucket of parameters `element_bytes` wide each (the parameters'
    own dtype: fp32 masters under mixed precision)."""
    return max(1, int(bucket_mb * 2**20 / element_bytes))


def cut(sizes: Sequence[float], bucket_elems: float) -> list[list[int]]:
    """The indices of the parameters of each bucket, for parameters of `sizes` elements in the
    order given (sizes may be fractions: the planner's shares of a parameter under tensor
    parallelism); at least one bucket."""
    groups: list[list[int]] = [[]]
    filled = 0.0
    for index, size in enumerate(sizes):
        if groups[-1] and filled + size > bucket_elems:
            groups.append([])
            filled = 0.0
        groups[-1].append(index)
        filled += size
    return groups


def plan_buckets(sizes: Sequence[int], bucket_elems: int, dp_size: int = 1) -> list[BucketPlan]:
    """The buckets of a flat buffer: each one's start, padded size, parameters and their offsets."""
    plans: list[BucketPlan] = []
    start = 0
    for members in cut(sizes, bucket_elems):
        offsets = [start]
        for index in members[:-1]:
            offsets.append(offsets[-1] + sizes[index])
        filled = sum(sizes[index] for index in members)
        plans.append(BucketPlan(start, -(-filled // dp_size) * dp_size, tuple(members), tuple(offsets)))
        start += plans[-1].size
    return plans


def bucket_fills(sizes: Sequence[float], bucket_elems: float) -> list[float]:
    """Elements of each bucket before padding: what each of its collectives moves."""
    return [sum(sizes[index] for index in members) for members in cut(sizes, bucket_elems)]
