"""Communication that overlaps (issue 53, item 3): ZeRO-1/2's parameter all-gathers start after the
optimizer step and are waited for bucket by bucket, each by the first forward that reads it; and
what the host still waits for is counted per step (comm_exposed_seconds_by_op)."""

from __future__ import annotations

import pytest

from strata.config import train_config
from strata.distributed import comm
from strata.parallel.data import gather_points
from strata.train import trainer

from distributed import run_on_ranks

BASE = dict(model="tiny", seq_len=16, micro_batch=1, global_batch=2, steps=3, progress=False, eval_batches=1,
            device="cpu", dtype="fp64", bucket_mb=0.02)  # ~2,600 fp64 elements a bucket: a dozen of them


def _gathers_seen_by_the_forward(settings: dict) -> dict:
    """After a step: the gathers in flight, and as each unit's forward begins, which of them are
    still in flight and which it waited for (its own buckets)."""
    run = trainer.setup(train_config(**{**BASE, **settings}))
    sharding = run.parallel.sharding
    trainer.train_step(run, 0)
    in_flight_after_step = sorted(sharding.gathers.in_flight)
    seen = []
    for module, params in gather_points(run.model):
        own = sorted({b.index for b in sharding.buckets for p in b.params if any(p is q for q in params)})
        # registered after overlap_gathers' hook: runs once that hook has waited
        module.register_forward_pre_hook(lambda m, a, own=own: seen.append((own, sorted(sharding.gathers.in_flight))))
    comm.counter.reset()
    trainer.train_step(run, 1)
    exposed = comm.counter.exposed_seconds_by_op()
    out = {"buckets": len(sharding.buckets), "after_step": in_flight_after_step, "seen": seen, "exposed": exposed}
    run.parallel.close()
    comm.close_streams()
    return out


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_1_and_2_gather_each_bucket_when_the_next_forward_reaches_it(zero):
    for rank in run_on_ranks(_gathers_seen_by_the_forward, 2, {"zero": zero}):
        buckets = rank["buckets"]
        assert buckets >= 4, buckets
        assert rank["after_step"] == list(range(buckets))  # none waited for by the step itself
        first_own, first_in_flight = rank["seen"][0]
        # the embedding's unit waited for its own buckets only: the rest were still in flight
        assert not set(first_own) & set(first_in_flight)
        assert len(first_in_flight) >= buckets - len(first_own) - 1 > 0
        for own, in_flight in rank["seen"]:
            assert not set(own) & set(in_flight)  # a unit never computes before its own gathers
        # the forwards waited for fewer and fewer: the last unit saw what no unit reads, if anything
        assert [len(f) for _, f in rank["seen"]] == sorted((len(f) for _, f in rank["seen"]), reverse=True)
        # the step's waits, counted: the forward's for the gathers, backward's for the reductions
        assert {"all_gather/dp", "reduce_scatter/dp"} <= set(rank["exposed"]), rank["exposed"]


# --- the gradient buckets' throttle (strata/parallel/bucket_reductions.py) ---------------------------
class _Work:
    """A collective's handle whose completion the test decides; counts the waits that would block."""

    def __init__(self, index: int, log: dict):
        self.index, self.log, self.completed = index, log, False

    def is_completed(self) -> bool:
        return self.completed

    def wait(self) -> None:
        self.log["blocking_waits"] += not self.completed  # NCCL: backward's stream stalls on the collective
        self.completed = True


def _throttle(limit, buckets: int = 6):
    """BucketReductions over `buckets` one-parameter buckets with fake works: (reductions, works by
    bucket, the buckets finished in order, the wait log)."""
    import torch
    from torch import nn

    from strata.parallel.bucket_reductions import BucketReductions
    from strata.parallel.buckets import plan_buckets

    plans, _ = plan_buckets([nn.Parameter(torch.zeros(8)) for _ in range(buckets)], bucket_elems=8, dp_size=2,
                            aligned=True)
    works, finished, log = {}, [], {"blocking_waits": 0}

    def start(bucket):
        works[bucket.index] = _Work(bucket.index, log)
        return works[bucket.index]
    reductions = BucketReductions(plans, lambda b, p: None, start, lambda b: finished.append(b.index), hooked=False,
                                  limit=limit)
    return reductions, plans, works, finished, log


def test_the_throttle_never_waits_for_reductions_that_have_completed():
    """Each earlier reduction done by the time the next bucket is launched: none is waited for
    (the old throttle waited for the oldest of every three: 4 stalls of backward in 6 buckets),
    and each is finished as it is found done, in launch order."""
    reductions, buckets, works, finished, log = _throttle(limit=2)
    for bucket in buckets:
        reductions._launch(bucket)
        works[bucket.index].completed = True  # done while backward computes the next bucket's gradients
    assert log["blocking_waits"] == 0 and finished == [0, 1, 2, 3, 4]
    reductions.complete()
    assert log["blocking_waits"] == 0 and finished == [0, 1, 2, 3, 4, 5]


def test_the_throttle_waits_only_while_more_than_the_limit_are_still_running():
    reductions, buckets, works, finished, log = _throttle(limit=2)
    for bucket in buckets[:3]:  # none done: the third launch waits for the oldest
        reductions._launch(bucket)
    assert (log["blocking_waits"], finished) == (1, [0])
    works[2].completed = True  # a later one done before an earlier: retired, no wait for bucket 1
    reductions._launch(buckets[3])
    assert (log["blocking_waits"], finished) == (1, [0, 2])
    assert [b.index for b, _ in reductions.in_flight.entries] == [1, 3]
    reductions._launch(buckets[4])  # three running again: the oldest is waited for
    assert (log["blocking_waits"], finished) == (2, [0, 2, 1])
    reductions.complete()  # the last bucket's launch waits for bucket 3, the end of backward for 4 and 5
    assert (log["blocking_waits"], finished) == (5, [0, 2, 1, 3, 4, 5])


def test_no_limit_leaves_every_reduction_in_flight_until_backward_ends():
    """ZeRO-0/1 reducing their permanent gradient buffer in place: no wait inside backward."""
    reductions, buckets, works, finished, log = _throttle(limit=None)
    for bucket in buckets:
        reductions._launch(bucket)
    assert (log["blocking_waits"], finished, len(reductions.in_flight)) == (0, [], 6)
    reductions.complete()
    assert (log["blocking_waits"], finished) == (6, [0, 1, 2, 3, 4, 5])


STAGE_LIMITS = [  # (zero, settings, whether its reductions are limited)
    (0, {}, False), (1, {}, False), (2, {}, True),
    # a bucket cast to another reduce dtype is a copy that lives while it is in flight
    (0, {"reduce_dtype": "bf16"}, True), (1, {"dtype": "bf16", "gather_dtype": "bf16"}, True),
    (1, {"dtype": "bf16", "gather_dtype": "bf16", "reduce_dtype": "bf16"}, False)]


def _stage_limits() -> list:
    limits = []
    for zero, settings, _ in STAGE_LIMITS:
        run = trainer.setup(train_config(**{**BASE, "dtype": "fp32", "zero": zero, **settings}))
        limits.append(run.parallel.sharding.reductions.limit)
        run.parallel.close()
    comm.close_streams()
    return limits


def test_each_stage_says_its_in_flight_limit():
    """No limit where a reduction in flight holds no memory of its own (rules/buckets.in_flight_limit)."""
    from strata.rules.constants import MAX_IN_FLIGHT
    for limits in run_on_ranks(_stage_limits, 2):
        assert limits == [MAX_IN_FLIGHT if limited else None for _, _, limited in STAGE_LIMITS]


def _in_flight_during_backward(zero: int) -> dict:
    """One step's reductions, counted: the most in flight after a launch, and the oldest waited
    for inside backward (by the throttle, not at its end). ZeRO-3's reduce-scatters go through
    the same queue (bucket_reductions.InFlight)."""
    run = trainer.setup(train_config(**{**BASE, "dtype": "fp64", "zero": zero}))
    sharding = run.parallel.sharding
    in_flight = sharding.hooks.in_flight if zero == 3 else sharding.reductions.in_flight
    seen = {"most": 0, "throttled": 0, "launched": 0}
    add, complete_oldest = in_flight.add, in_flight.complete_oldest

    def counted_add(key, work):
        in_flight.complete_oldest = lambda: (seen.__setitem__("throttled", seen["throttled"] + 1), complete_oldest())
        add(key, work)
        in_flight.complete_oldest = complete_oldest
        seen["most"], seen["launched"] = max(seen["most"], len(in_flight)), seen["launched"] + 1
    in_flight.add = counted_add
    trainer.train_step(run, 0)
    out = {**seen, "buckets": seen["launched"] if zero == 3 else len(sharding.buckets)}
    run.parallel.close()
    comm.close_streams()
    return out


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_only_zero2_and_3_throttle_their_reductions_in_a_real_step(zero):
    """Two ranks, a dozen buckets (ZeRO-3: a unit each): ZeRO-0/1 never wait inside backward;
    ZeRO-2 and 3 keep at most MAX_IN_FLIGHT staging buffers reducing."""
    from strata.rules.constants import MAX_IN_FLIGHT
    for rank in run_on_ranks(_in_flight_during_backward, 2, zero):
        assert rank["buckets"] >= (4 if zero == 3 else 6) > MAX_IN_FLIGHT, rank  # tiny: 4 units
        if zero < 2:
            assert rank["throttled"] == 0, rank
        else:
            assert rank["most"] <= MAX_IN_FLIGHT, rank
