"""Hybrid sharding (--dp-shard N / --dp-replicate M; FSDP's HSDP): ZeRO-1/2/3 over shard groups of
2 adjacent ranks, kept as 2 replicas, reproduce one process in fp64 to 1e-10; a shard group moves
what flat ZeRO moves over 2 ranks, and the replicas all-reduce 1/2 of the gradients once a step;
a checkpoint is written by the first replica only and any layout reads it; what it does not run
with is one line."""

from __future__ import annotations

import json

import pytest
import torch

from strata.config import train_config
from strata.distributed import comm
from strata.train import trainer

from cli_runner import assert_refused_in_one_line, run_strata
from distributed import run_on_ranks

BASE = dict(model="tiny", seq_len=16, micro_batch=1, steps=6, progress=False, eval_batches=1, device="cpu",
            dtype="fp64", lr=3e-3, seed=7, bucket_mb=0.02)


def _losses(settings: dict) -> list[float]:
    return trainer.train(train_config(**{**BASE, "global_batch": 8, **settings}))["losses"]


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_shard_2_x_replicate_2_equals_one_process_in_fp64(zero):
    reference = _losses({"nproc": 1})
    for losses in run_on_ranks(_losses, 4, {"zero": zero, "dp_shard": 2}):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-10, atol=0)


def _step_bytes(settings: dict) -> dict:
    """One step's bytes by operation and group, and the elements of this rank's gradient shards."""
    run = trainer.setup(train_config(**{**BASE, **settings}))
    comm.counter.reset()
    trainer.train_step(run, 0)
    out = {"sent": dict(comm.counter.bytes_sent),
           "shard_elements": sum(g.numel() for g, _ in run.parallel.sharding.grad_pairs())}
    run.parallel.close()
    comm.close_streams()
    return out


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_a_shard_group_moves_flat_zeros_bytes_the_replicas_half_the_gradients_and_the_planner_prices_both(zero):
    """fp32, one micro-batch of one sequence a rank in both runs: a shard group of 2 (of 4 ranks)
    reduce-scatters and gathers exactly what flat ZeRO on 2 ranks does; the replicas (2) all-reduce
    this rank's gradient shard once, 2 (M - 1) / M x its bytes; all of it, less the gradient norm's
    two fp64 squares, is `strata plan`'s data-parallel bytes within the flat buffers' padding, and the
    states are priced as sharded over 2 ranks, not 4."""
    from strata.model.presets import get_preset
    from strata.plan.cost import estimate
    from strata.plan.inputs import build_cluster, workload
    from strata.rules.layout import Layout
    settings = {"zero": zero, "dtype": "fp32", "bucket_mb": 25.0}  # the planner's default buckets
    flat = run_on_ranks(_step_bytes, 2, {**settings, "global_batch": 2})
    hybrid = run_on_ranks(_step_bytes, 4, {**settings, "global_batch": 4, "dp_shard": 2})
    for rank, sharded in enumerate(hybrid):
        alone = flat[rank % 2]
        for op in ("reduce_scatter", "all_gather"):
            assert sharded["sent"].get((op, "dp_shard"), 0) == alone["sent"].get((op, "dp"), 0) > 0, op
        assert sharded["shard_elements"] == alone["shard_elements"]
        assert sharded["sent"][("all_reduce", "dp_replicate")] == 2 * (2 - 1) / 2 * sharded["shard_elements"] * 4
    sent = hybrid[0]["sent"]
    moved = sum(sent.get((op, "dp_shard"), 0) for op in ("reduce_scatter", "all_gather", "all_reduce")) - 16 + \
        sent[("all_reduce", "dp_replicate")]
    work, cluster = workload(get_preset("tiny"), 4, 16, "fp32"), build_cluster("A100-80G", 1, 4, None, "ib-200")
    planned = estimate(work, cluster, Layout(dp=4, zero=zero, dp_shard=2, micro_batch=1))
    flat_planned = estimate(work, cluster, Layout(dp=4, zero=zero, micro_batch=1))
    assert moved == pytest.approx(planned.comm_bytes["dp"], rel=1e-3)
    states = planned.memory_breakdown["optimizer_states"]
    assert states == pytest.approx(2 * flat_planned.memory_breakdown["optimizer_states"], rel=1e-9)


def _saved_and_read(directory: str) -> list[float]:
    first = trainer.train(train_config(**{**BASE, "global_batch": 8, "zero": 2, "dp_shard": 2, "save": directory,
                                          "save_every": 3}))
    return first["losses"]


def _resumed(checkpoint: str) -> list[float]:
    return trainer.train(train_config(**{**BASE, "global_batch": 8, "zero": 1, "resume": checkpoint}))["losses"]


def test_the_first_replica_writes_the_checkpoint_and_flat_zero_on_2_ranks_resumes_it(tmp_path):
    """Saved by shard 2 x replicate 2 (ZeRO-2) at step 3 of 6, resumed there by flat ZeRO-1 on 2 ranks:
    its last 3 losses are the uninterrupted run's (one process), and only ranks 0 and 1 (the first
    replica) wrote pieces (every rank writes its random streams)."""
    reference = _losses({"nproc": 1})
    run_on_ranks(_saved_and_read, 4, str(tmp_path / "ck"))
    regions = [len(json.loads(path.read_text())["regions"])
               for path in sorted((tmp_path / "ck" / "step_000003").glob("shard_*.json"))]
    assert regions[0] > 0 and regions[1] > 0 and regions[2:] == [0, 0], regions  # ranks 2, 3: their random streams
    for losses in run_on_ranks(_resumed, 2, str(tmp_path / "ck" / "step_000003")):
        torch.testing.assert_close(torch.tensor(losses[-3:]), torch.tensor(reference[-3:]), rtol=1e-10, atol=0)


@pytest.mark.parametrize("flags,needle", [
    (["--nproc", "4", "--dp-shard", "2"], "--dp-shard 2: shards ZeRO's states, and zero is 0"),
    (["--nproc", "4", "--zero", "1", "--dp-shard", "3"], "--dp-shard 3: must divide dp 4"),
    (["--nproc", "4", "--zero", "1", "--dp-replicate", "4"], "--dp-replicate 4: leaves 1 rank to shard over"),
    (["--nproc", "4", "--zero", "1", "--dp-shard", "2", "--dp-replicate", "1"],
     "--dp-shard 2: x dp_replicate 1 must equal dp 4"),
    (["--nproc", "4", "--zero", "1", "--pp", "2", "--dp-shard", "2", "--global-batch", "8"],
     "runs with data and tensor parallelism for now"),
])
def test_what_hybrid_sharding_does_not_run_with_is_one_line(flags, needle):
    result = run_strata("train", "--model", "tiny", "--steps", "1", "--micro-batch", "1", *flags)
    assert_refused_in_one_line(result, needle)


def test_the_search_offers_a_nodes_shard_group_and_explain_compares_it_with_flat_zero():
    from strata.model.presets import get_preset
    from strata.plan.inputs import build_cluster, workload
    from strata.plan.search import explain, node_shards, search
    from strata.rules.layout import Layout
    assert node_shards(Layout(dp=32, zero=3), 8) == 8 and node_shards(Layout(dp=16, tp=2, zero=1), 8) == 4
    assert node_shards(Layout(dp=8, zero=3), 8) is None  # one node: nothing to replicate across
    assert node_shards(Layout(dp=32, zero=0), 8) is None and node_shards(Layout(dp=16, pp=2, zero=1), 8) is None
    work, cluster = workload(get_preset("llama-1b"), 64, 2048, "bf16"), build_cluster("A100-80G", 2, 4, None, "100gbe")
    ranked, rejected = search(work, cluster, offload=False)
    assert any(e.layout.dp_shard == 4 for e in ranked)
    lines = explain(ranked[0], ranked, rejected, cluster)
    other = "with ZeRO over every dp rank" if ranked[0].layout.dp_shard else "with hybrid sharding"
    assert any(line.startswith(other) and "slower" in line for line in lines), lines
