"""ZeRO++'s hpZ (--hpz-partition-size K; Wang et al. 2023, section 3.2): ZeRO-3 over 4 dp ranks whose
backward gathers each unit from a secondary copy on 2 adjacent ranks reproduces one process in fp64
to 1e-10 (losses and final parameters, over two micro-batches a step); a step moves, per unit, its
padded size x (N-1)/N gathered forward and reduce-scattered over dp and x (K-1)/K gathered backward
over the node group, holds 1/K of it between the two, and the planner prices those bytes; a
checkpoint saved under hpZ resumes under flat ZeRO-3; what it does not run with is one line."""

from __future__ import annotations

import pytest
import torch

from strata.config import train_config
from strata.distributed import comm
from strata.train import trainer

from cli_runner import assert_refused_in_one_line, run_strata
from distributed import run_on_ranks

BASE = dict(model="tiny", seq_len=16, micro_batch=1, steps=4, progress=False, eval_batches=1, device="cpu",
            dtype="fp64", lr=3e-3, seed=7, bucket_mb=0.02)
HPZ = {"zero": 3, "hpz_partition_size": 2}


def _summary(settings: dict) -> dict:
    summary = trainer.train(train_config(**{**BASE, "global_batch": 8, **settings}), keep_state=True)
    return {"losses": summary["losses"], "state": {k: v.cpu() for k, v in summary["state"].items()}}


@pytest.mark.parametrize("world,extra", [(4, {}), (8, {"tp": 2}), (4, {"model": "tiny-gpt2", "checkpointing": "full"})])
def test_hpz_2_of_4_dp_ranks_equals_one_process_in_fp64(world, extra):
    """dp 4 (with tp 2: 8 ranks); tiny-gpt2 ties its embedding (its unit stays gathered to the head's
    backward: no copy), with every block recomputed in backward."""
    reference = _summary({"nproc": 1, **({"model": extra["model"]} if "model" in extra else {})})
    for got in run_on_ranks(_summary, world, {**HPZ, **extra}):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(reference["losses"]), rtol=1e-10, atol=0)
        assert got["state"].keys() == reference["state"].keys()
        for name, value in reference["state"].items():
            torch.testing.assert_close(got["state"][name], value, rtol=1e-10, atol=1e-12, msg=name)


def _step(settings: dict) -> dict:
    """One step (one micro-batch): bytes by operation and group, each unit's padded size, and the
    bytes of hpZ's copies held once the forward is over."""
    run = trainer.setup(train_config(**{**BASE, **settings}))
    sharding = run.parallel.sharding
    held = []
    run.model.register_forward_hook(lambda *_: held.append(
        sum(u.secondary.numel() * u.secondary.element_size() for u in sharding.units if u.secondary is not None)))
    comm.counter.reset()
    trainer.train_step(run, 0)
    out = {"sent": dict(comm.counter.bytes_sent), "units": [u.full.numel() for u in sharding.units],
           "element": sharding.units[0].full.element_size(), "held": held,
           "kept": [u.keep_after_forward for u in sharding.units]}
    run.parallel.close()
    comm.close_streams()
    return out


def test_hpz_moves_and_holds_what_its_formula_says_and_the_planner_prices_it():
    """fp32, 4 ranks, K = 2, one sequence a rank: per unit of padded size S (E bytes an element),
    dp all-gather S·E·3/4 (forward), dp reduce-scatter S·E·3/4, dp_node all-gather S·E·1/2
    (backward); S·E/2 held after the forward; flat ZeRO-3 gathers S·E·3/4 twice over dp. The
    planner's data-parallel bytes (less the gradient norm's two fp64 squares) and its hpZ buffer
    equal them within the units' padding."""
    from strata.model.presets import get_preset
    from strata.plan.cost import estimate
    from strata.plan.inputs import build_cluster, workload
    from strata.rules.layout import Layout
    n, k, common = 4, 2, {"dtype": "fp32", "global_batch": 4, "bucket_mb": 25.0}
    hpz = run_on_ranks(_step, n, {**common, **HPZ})
    flat = run_on_ranks(_step, n, {**common, "zero": 3})
    for got, alone in zip(hpz, flat):
        assert not any(got["kept"])  # tiny's embedding is untied: every unit is gathered again for backward
        unit_bytes = sum(got["units"]) * got["element"]
        sent = got["sent"]
        assert sent[("all_gather", "dp")] == unit_bytes * (n - 1) / n
        assert sent[("reduce_scatter", "dp")] == unit_bytes * (n - 1) / n
        assert sent[("all_gather", "dp_node")] == unit_bytes * (k - 1) / k
        assert alone["sent"][("all_gather", "dp")] == 2 * unit_bytes * (n - 1) / n
        assert alone["sent"][("reduce_scatter", "dp")] == sent[("reduce_scatter", "dp")]
        assert got["held"] == [unit_bytes / k] and alone["held"] == [0]
    sent = hpz[0]["sent"]
    moved = sent[("all_gather", "dp")] + sent[("reduce_scatter", "dp")] + sent[("all_gather", "dp_node")] + \
        sent.get(("all_reduce", "dp"), 0) - 16
    work, cluster = workload(get_preset("tiny"), n, 16, "fp32"), build_cluster("A100-80G", 1, n, None, "ib-200")
    planned = estimate(work, cluster, Layout(dp=n, zero=3, hpz_partition_size=k, micro_batch=1))
    flat_planned = estimate(work, cluster, Layout(dp=n, zero=3, micro_batch=1))
    assert moved == pytest.approx(planned.comm_bytes["dp"], rel=1e-3)
    extra = planned.memory_breakdown["buffers"] - flat_planned.memory_breakdown["buffers"]
    assert extra == pytest.approx(hpz[0]["held"][0], rel=1e-3)


def _saved(directory: str) -> list[float]:
    return trainer.train(train_config(**{**BASE, "global_batch": 8, **HPZ, "save": directory, "save_every": 2}))[
        "losses"]


def _resumed(checkpoint: str) -> list[float]:
    return trainer.train(train_config(**{**BASE, "global_batch": 8, "zero": 3, "resume": checkpoint}))["losses"]


def test_a_checkpoint_saved_under_hpz_resumes_under_flat_zero_3(tmp_path):
    """Saved by hpZ (4 ranks, K 2) at step 2 of 4, resumed there by flat ZeRO-3 on 2 ranks: its last
    2 losses are the uninterrupted one process's."""
    reference = _summary({"nproc": 1})["losses"]
    run_on_ranks(_saved, 4, str(tmp_path / "ck"))
    for losses in run_on_ranks(_resumed, 2, str(tmp_path / "ck" / "step_000002")):
        torch.testing.assert_close(torch.tensor(losses[-2:]), torch.tensor(reference[-2:]), rtol=1e-10, atol=0)


@pytest.mark.parametrize("flags,needle", [
    (["--nproc", "4", "--zero", "1", "--hpz-partition-size", "2"], "--hpz-partition-size 2: keeps a copy of ZeRO-3"),
    (["--nproc", "4", "--zero", "3", "--hpz-partition-size", "3"], "--hpz-partition-size 3: must divide dp 4"),
    (["--nproc", "4", "--zero", "3", "--hpz-partition-size", "4"], "--hpz-partition-size 4: must divide dp 4"),
    (["--nproc", "8", "--zero", "3", "--pp", "2", "--hpz-partition-size", "2", "--global-batch", "8"],
     "--hpz-partition-size 2: runs with data and tensor parallelism for now"),
    (["--nproc", "8", "--zero", "3", "--dp-shard", "4", "--hpz-partition-size", "2", "--global-batch", "8"],
     "--hpz-partition-size 2: not with hybrid sharding"),
])
def test_what_hpz_does_not_run_with_is_one_line(flags, needle):
    result = run_strata("train", "--model", "tiny", "--steps", "1", "--micro-batch", "1", *flags)
    assert_refused_in_one_line(result, needle)


def test_the_search_offers_hpz_over_a_nodes_dp_ranks_and_explain_compares_it():
    from strata.model.presets import get_preset
    from strata.plan.inputs import build_cluster, workload
    from strata.plan.search import explain, layouts, search
    work = workload(get_preset("llama-1b"), 64, 2048, "bf16")
    offered = [lay for lay in layouts(work, 8, offload=False, per_node=4) if lay.hpz_partition_size > 1]
    assert offered and all(lay.zero == 3 and lay.hpz_partition_size * lay.tp == 4 for lay in offered)
    assert {lay.hpz_partition_size for lay in offered} == {2, 4}  # (dp 8, tp 1) and (dp 4, tp 2)
    assert not any(lay.hpz_partition_size > 1 for lay in layouts(work, 4, offload=False, per_node=4))  # one node
    from strata.plan.report import parse_layout
    assert all(parse_layout(lay.describe(), work, 8) == lay for lay in offered[:20])  # "hpz=K" reads back
    cluster = build_cluster("A100-80G", 2, 4, None, "100gbe")
    ranked, rejected = search(work, cluster, offload=False)
    lines = explain(ranked[0], ranked, rejected, cluster)
    assert any("hpZ" in line for line in lines), lines
