"""How gradients are cut into buckets (--bucket-mb): the rule the runtime lays its flat buffers out
by (strata/parallel/buckets.py) and the planner counts data parallelism's collectives with
(strata/plan/data_parallel.py), one collective per bucket.

Parameters are taken in the order given (the runtime gives them back to front, the order backward
produces their gradients) and added to the current bucket until the next one would take it past
the bucket's elements; a parameter never straddles two buckets, so one larger than a bucket has a
bucket of its own, and so has a small one between two such. Each bucket is padded to a multiple of
the data-parallel size so that it splits into equal shards.

Aligned (ZeRO-0/1/2's buffers, `aligned=True`): each parameter starts on a multiple of
PARAM_ALIGN_ELEMENTS and each bucket is padded to a multiple of BUCKET_ALIGN_ELEMENTS and of dp
shards of PARAM_ALIGN_ELEMENTS, so every parameter's view, every bucket and every rank's shard of
it start aligned (rules/constants.py says why). The cut counts the parameters alone, aligned or not.
ZeRO-3's units are packed (strata/parallel/zero3_units.py; the planner prices them unpadded)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from strata.rules.constants import BUCKET_ALIGN_ELEMENTS, MAX_IN_FLIGHT, PARAM_ALIGN_ELEMENTS


@dataclass(frozen=True)
class BucketPlan:
    start: int  # first element in the flat buffer
    size: int  # elements, padded to a multiple of the dp size (aligned: of bucket_multiple(dp))
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


def round_up(value: float, multiple: int) -> float:
    """The least multiple of `multiple` not below `value` (an int for ints; the planner's fractional
    shares of parameters round alike; a multiple of 1 leaves a share as it is)."""
    return value if multiple == 1 else -(-value // multiple) * multiple


def bucket_multiple(dp_size: int, aligned: bool) -> int:
    """What a bucket's size is a multiple of: dp equal shards, each of whole PARAM_ALIGN_ELEMENTS
    and the bucket of whole BUCKET_ALIGN_ELEMENTS when aligned (so the next bucket starts aligned)."""
    return math.lcm(BUCKET_ALIGN_ELEMENTS, dp_size * PARAM_ALIGN_ELEMENTS) if aligned else dp_size


def plan_buckets(sizes: Sequence[int], bucket_elems: int, dp_size: int = 1, aligned: bool = False) -> list[BucketPlan]:
    """The buckets of a flat buffer: each one's start, padded size, parameters and their offsets
    (aligned: each offset a multiple of PARAM_ALIGN_ELEMENTS, the gaps padding)."""
    param_multiple, multiple = (PARAM_ALIGN_ELEMENTS if aligned else 1), bucket_multiple(dp_size, aligned)
    plans: list[BucketPlan] = []
    start = 0
    for members in cut(sizes, bucket_elems):
        offsets, end = [], start
        for index in members:
            offsets.append(round_up(end, param_multiple))
            end = offsets[-1] + sizes[index]
        plans.append(BucketPlan(start, round_up(end - start, multiple), tuple(members), tuple(offsets)))
        start += plans[-1].size
    return plans


def bucket_fills(sizes: Sequence[float], bucket_elems: float, dp_size: int = 1, aligned: bool = False) -> list[float]:
    """Elements of each bucket, padded as the runtime lays it out on `dp_size` ranks: what each of
    its collectives moves (a reduce-scatter's input, an all-gather's output, an all-reduce's tensor)."""
    return [plan.size for plan in plan_buckets(sizes, bucket_elems, dp_size, aligned)]


def in_flight_limit(stage: int, reduces_in_place: bool) -> int | None:
    """How many of a stage's bucket reductions may be in flight before the oldest is waited for
    (None: no limit). One holding memory of its own while in flight is limited to MAX_IN_FLIGHT:
    ZeRO-2's staging buffer, ZeRO-0/1's copy of a bucket in another reduce dtype. ZeRO-0/1
    reducing their gradient buffer in place hold nothing more: the buffer is permanent."""
    return None if stage < 2 and reduces_in_place else MAX_IN_FLIGHT
