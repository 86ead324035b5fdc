"""Hybrid sharding (--dp-shard N / --dp-replicate M; FSDP's HSDP): ZeRO-1/2/3 over shard groups of
2 adjacent ranks, kept as 2 replicas, reproduce one process in fp64 to 1e-10; a shard group moves
what flat ZeRO moves over 2 ranks, and the replicas all-reduce 1/2 of the gradients once a step;
a checkpoint is written by the first replica only and any layout reads it; what it does not run
with is one line. Beside a pipeline (shard 2 x replicate 2 x pp 2, 8 ranks, one launch): ZeRO-1/2/3
reproduce one process in fp64, each stage's groups move the formula's and the planner's bytes, a
checkpoint resumes on one process; the planner prices it per stage and searches it."""

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
    (["--nproc", "8", "--zero", "1", "--cp", "2", "--dp-shard", "2", "--global-batch", "8"],
     "--dp-shard 2: runs with data, tensor and pipeline parallelism for now (cp and ep 1)"),
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
    assert node_shards(Layout(dp=32, zero=0), 8) is None and node_shards(Layout(dp=16, pp=2, zero=1), 8) == 8
    work, cluster = workload(get_preset("llama-1b"), 64, 2048, "bf16"), build_cluster("A100-80G", 2, 4, None, "100gbe")
    ranked, rejected = search(work, cluster, offload=False)
    assert any(e.layout.dp_shard == 4 for e in ranked)
    lines = explain(ranked[0], ranked, rejected, cluster)
    other = "with ZeRO over every dp rank" if ranked[0].layout.dp_shard else "with hybrid sharding"
    assert any(line.startswith(other) and "slower" in line for line in lines), lines


# --- beside a pipeline: shard 2 x replicate 2 x pp 2 on 8 ranks, one launch ----------------------------
PIPELINE = dict(seq_len=16, steps=3, progress=False, peak_flops=1e10, eval_batches=1, lr=3e-3, seed=5, micro_batch=1,
                dtype="fp64", n_layers=4, global_batch=8)  # m = 2 micro-batches per dp rank, 2 blocks per stage
HSDP_PP = dict(pp=2, dp=4, dp_shard=2)
# with tiny-gpt2, whose embedding is tied (a copy on each stage); PipeDream-2BW (asynchronous) against
# the single process of its rule (`--pp 1 --schedule 2bw`, tests/test_async_pipeline.py)
TRAINED = [{"zero": 3}, {"zero": 3, "reshard_after_forward": False}, {"zero": 2}, {"zero": 1},
           {"zero": 1, "schedule": "2bw", "grad_clip": 0.0}]
COUNTED = [(3, True), (2, True)]  # one step in fp32 of tiny (untied), 25 MB buckets, as the planner's
NO_GRADIENT = ".attn.wk.bias"  # no gradient in exact arithmetic: rounding noise after Adam (test_zero_pipeline.py)


def _pipeline_step_bytes(zero: int, reshard: bool) -> dict:
    """One step's bytes this rank sent by (op, group); the padded elements ZeRO gathers and
    reduce-scatters on this stage (its units, or its buckets) and this rank's gradient shard's."""
    run = trainer.setup(train_config(**{**PIPELINE, **HSDP_PP, "model": "tiny", "dtype": "fp32", "zero": zero,
                                        "reshard_after_forward": reshard, "bucket_mb": 25.0, "steps": 1}))
    comm.counter.reset()
    trainer.train_step(run, 0)
    sharding = run.parallel.sharding
    sizes = [u.bucket.size for u in sharding.units] if zero == 3 else [b.size for b in sharding.buckets]
    out = {"sent": dict(comm.counter.bytes_sent), "elements": sum(sizes), "pp_rank": run.dims.coordinates(run.rank)["pp"],
           "shard_elements": sum(g.numel() for g, _ in sharding.grad_pairs()),
           "params": sum(p.numel() for p in run.model.parameters())}
    run.parallel.close()
    comm.close_streams()
    return out


def _beside_a_pipeline(directory: str) -> dict:
    trained = []
    for case in TRAINED:
        summary = trainer.train(train_config(**{**PIPELINE, **HSDP_PP, "model": "tiny-gpt2", **case}), keep_state=True)
        trained.append((summary["losses"], summary["val_losses"], {k: v.cpu() for k, v in summary["state"].items()}))
    saved = trainer.train(train_config(**{**PIPELINE, **HSDP_PP, "model": "tiny-gpt2", "zero": 3, "steps": 6,
                                          "save": directory, "save_every": 3}))["losses"]
    return {"trained": trained, "counted": [_pipeline_step_bytes(*case) for case in COUNTED], "saved": saved}


@pytest.fixture(scope="module")
def beside_a_pipeline(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hsdp_pp") / "ck"
    return run_on_ranks(_beside_a_pipeline, 8, str(directory), timeout=600), directory


def _one_process(steps: int = 3, **settings) -> dict:
    return trainer.train(train_config(**{**PIPELINE, "model": "tiny-gpt2", "steps": steps, **settings}), keep_state=True)


def test_shard_2_x_replicate_2_x_pp_2_equals_one_process_in_fp64(beside_a_pipeline):
    """ZeRO-3 gathering per micro-batch and with the stage's units kept gathered, ZeRO-2, ZeRO-1 and
    ZeRO-1 under 2BW, on 8 ranks (each stage sharded over its 2-rank shard groups, all-reduced across its 2 replicas;
    the tied embedding's copies summed over the first and last stage): every rank's losses, final
    validation loss and final parameters are the single process's to 1e-10."""
    ranks, _ = beside_a_pipeline
    references = {}  # by the rule the case follows: the schedule's (and its clipping)
    for i, case in enumerate(TRAINED):
        rule = tuple((k, v) for k, v in case.items() if k in ("schedule", "grad_clip"))
        if rule not in references:
            references[rule] = _one_process(**dict(rule))
        reference = references[rule]
        for rank in ranks:
            losses, val_losses, state = rank["trained"][i]
            torch.testing.assert_close(losses, reference["losses"], rtol=1e-10, atol=0, msg=str(case))
            torch.testing.assert_close(val_losses[-1][1], reference["val_losses"][-1][1], rtol=1e-10, atol=0)
            assert set(state) == set(reference["state"])
            for name, value in reference["state"].items():
                if NO_GRADIENT not in name:
                    torch.testing.assert_close(state[name], value, rtol=1e-10, atol=1e-12, msg=f"{case} {name}")


@pytest.mark.parametrize("zero,reshard", COUNTED)
def test_beside_a_pipeline_the_groups_move_the_formula_and_the_planners_bytes(beside_a_pipeline, zero, reshard):
    """fp32, m = 2: per stage, ZeRO-3 moves 2m gathers and m reduce-scatters of its units over its
    shard group (N = 2), ZeRO-2 one reduce-scatter of its buckets after the schedule and one gather,
    each (N-1)/N of the padded elements x 4 bytes; then the replicas (M = 2) all-reduce the rank's
    gradient shard (1/N of them, less ZeRO-2's bucket padding) once, 2(M-1)/M x its bytes. The
    planner's data-parallel bytes for each stage are the sum, its all-reduce of the padded shard."""
    from strata.model.presets import get_preset
    from strata.plan.buckets import collective_parts
    from strata.plan.data_parallel import data_parallel_seconds
    from strata.plan.inputs import build_cluster
    from strata.plan.stages import stage_loads
    from strata.rules.layout import Layout
    ranks, _ = beside_a_pipeline
    m, ring, replicas = 2, (2 - 1) / 2, 2
    gathers, scatters = (2 * m, m) if zero == 3 and reshard else (1, 1)
    cfg = get_preset("tiny").with_overrides(n_layers=4)
    lay = Layout(dp=4, pp=2, zero=zero, reshard_after_forward=reshard, micro_batch=1, dp_shard=2)
    cluster, loads = build_cluster("A100-80G", 2, 4, None, "ib-200"), stage_loads(cfg, 2, 1, 16)
    for rank in ranks:
        counted = rank["counted"][COUNTED.index((zero, reshard))]
        sent, elements = counted["sent"], counted["elements"]
        padding = elements / 2 - counted["shard_elements"]  # ZeRO-2's buckets' (its shards' views leave it out)
        assert padding == 0 if zero == 3 else 0 <= padding < elements / 100
        assert sent[("all_gather", "dp_shard")] == gathers * ring * elements * 4
        assert sent[("reduce_scatter", "dp_shard")] == scatters * ring * elements * 4
        assert sent[("all_reduce", "dp_replicate")] == 2 * (replicas - 1) / replicas * counted["shard_elements"] * 4
        load = loads[counted["pp_rank"]]
        assert load.params == counted["params"]
        parts = collective_parts(cfg, lay, load.layers, load.first, load.last, None, load.params, 25.0)
        planned = data_parallel_seconds(cluster, lay, parts, m, 1.0, 1.0)[2]
        moved = sum(sent[(op, group)] for op, group in (("all_gather", "dp_shard"), ("reduce_scatter", "dp_shard"),
                                                         ("all_reduce", "dp_replicate")))
        # the planner all-reduces the padded shard
        assert moved + 2 * (replicas - 1) / replicas * padding * 4 == pytest.approx(planned, rel=1e-12)


def test_a_shard_x_replicate_x_pp_checkpoint_resumes_on_one_process(beside_a_pipeline):
    """Saved at step 3 of 6 by shard 2 x replicate 2 x pp 2 (ZeRO-3, tied embedding), resumed there by
    one process: its last 3 losses are the uninterrupted single process's."""
    ranks, directory = beside_a_pipeline
    reference = _one_process(6)["losses"]
    torch.testing.assert_close(ranks[0]["saved"], reference, rtol=1e-10, atol=0)
    resumed = _one_process(6, resume=str(directory / "step_000003"))["losses"]
    torch.testing.assert_close(resumed[-3:], reference[-3:], rtol=1e-10, atol=0)


def test_the_planner_prices_hybrid_sharding_per_stage_and_searches_it_beside_a_pipeline():
    """No launch: under pp 2, shard 4 x replicate 2 holds twice flat ZeRO-3's (over 8) optimizer
    states per stage, and its data-parallel bytes are ZeRO-3's over 4 ranks plus the replicas'
    all-reduce of the stage's shard, 2(M-1)/M x its bytes; the search offers it beside a pipeline."""
    from strata.model.presets import get_preset
    from strata.plan.cost import estimate
    from strata.plan.inputs import build_cluster, workload
    from strata.plan.search import layouts
    from strata.plan.stages import stage_loads
    from strata.rules.layout import Layout
    cfg = get_preset("llama-1b")
    work, cluster = workload(cfg, 64, 2048, "bf16"), build_cluster("A100-80G", 2, 8, None, "100gbe")
    hybrid = estimate(work, cluster, Layout(dp=8, pp=2, zero=3, dp_shard=4, micro_batch=1))
    flat = estimate(work, cluster, Layout(dp=8, pp=2, zero=3, micro_batch=1))
    flat_over_4 = estimate(workload(cfg, 32, 2048, "bf16"), build_cluster("A100-80G", 1, 8, None, "100gbe"),
                           Layout(dp=4, pp=2, zero=3, micro_batch=1))  # the same micro-batches per rank
    states = hybrid.memory_breakdown["optimizer_states"]
    assert states == pytest.approx(2 * flat.memory_breakdown["optimizer_states"], rel=1e-9)
    stage = max(load.params for load in stage_loads(cfg, 2, 1, 2048))
    replicas_bytes = 2 * (2 - 1) / 2 * stage / 4 * 4
    assert hybrid.comm_bytes["dp"] == pytest.approx(flat_over_4.comm_bytes["dp"] + replicas_bytes, rel=1e-9)
    # 4 nodes of 8: a stage's 16 dp ranks span 2 nodes, each node's 8 a shard group
    offered = [lay for lay in layouts(work, 32, offload=False, per_node=8) if lay.pp > 1 and lay.dp_shard]
    assert offered and all(lay.dp_shard * lay.tp == 8 for lay in offered)
