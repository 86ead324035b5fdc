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
