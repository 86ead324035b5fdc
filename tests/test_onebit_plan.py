"""The planner's side of 1-bit Adam and 0/1 Adam (--compress onebit|zeroone): its data-parallel
bytes are rules/compression.py's formulas, its memory counts the error buffers (and ZeRO-1's whole
momentum, 0/1 Adam's flat gradient), the search offers the compressed layouts where they run, and
--parallel auto prices the user's compression. The runtime's side: tests/test_onebit_adam.py."""

from __future__ import annotations

import pytest

from strata.rules.compression import onebit_padded, onebit_wire_bytes, variance_updates


def test_the_planner_counts_the_formulas_bytes_and_the_error_buffers():
    """`strata plan` for a 1B model on 8 nodes of 8 GPUs over 10 GbE: its data-parallel bytes are
    the two rounds of onebit_wire_bytes (fp32 scales) over the model's padded buckets, the error
    buffers are the worker's (the model) and the server's (1/dp) in fp32, and the step is faster
    than ZeRO-0's all-reduce there. (Its scales per row: the bytes test above checks the planner's
    count against the runtime's on tiny.)"""
    import dataclasses

    from strata.model.presets import get_preset
    from strata.plan.buckets import onebit_scales
    from strata.plan.cost import estimate
    from strata.plan.inputs import build_cluster, workload
    from strata.plan.memory import onebit_error_bytes
    from strata.rules.layout import Layout
    cfg = get_preset("llama-1b")
    work, cluster = workload(cfg, 512, 2048, "bf16"), build_cluster("A100-80G", 8, 8, None, "10gbe")
    plain = Layout(dp=64, checkpointing="full", micro_batch=1)
    compressed = dataclasses.replace(plain, compress="onebit", compress_after=100)
    a, b = estimate(work, cluster, plain), estimate(work, cluster, compressed)
    params = a.comm_bytes["dp"] / (2 * 63 / 64 * 4)  # ZeRO-0's all-reduce of the fp32 padded buckets
    scales = onebit_scales(cfg, cfg.n_layers, 64)
    # the embedding's rows (a scale each) fill the first chunks: a chunk's elements over a row's
    assert abs(scales - onebit_padded(round(params), 64) / 64 / cfg.d_model) <= 2
    assert 64 * scales * 4 < onebit_wire_bytes(round(params), 64, 4) / 50  # under 2% of the wire
    assert b.comm_bytes["dp"] == pytest.approx(2 * 63 / 64 * onebit_wire_bytes(round(params), 64, 4, scales), rel=1e-9)
    assert b.comm_bytes["dp"] < a.comm_bytes["dp"] / 30
    gradients = b.memory_breakdown["gradients"] - a.memory_breakdown["gradients"]
    assert gradients == pytest.approx(onebit_error_bytes(cfg.num_params(), 64), rel=1e-6)
    assert b.fits and b.step_time_s < a.step_time_s


def test_the_planner_prices_zero1s_parameter_gather_and_whole_momentum():
    """Under ZeRO-1 the planner adds the uncompressed all-gather of the updated fp32 parameters to
    the two 1-bit rounds (so ZeRO-1 saves memory, not bytes: the step is slower than ZeRO-0's),
    shards v (and 0/1 Adam's m), and keeps 1-bit Adam's momentum whole beyond its shard."""
    import dataclasses

    from strata.model.presets import get_preset
    from strata.plan.cost import estimate
    from strata.plan.inputs import build_cluster, workload
    from strata.rules.layout import Layout
    cfg = get_preset("llama-1b")
    work, cluster = workload(cfg, 512, 2048, "bf16"), build_cluster("A100-80G", 8, 8, None, "10gbe")
    plain = Layout(dp=64, checkpointing="full", micro_batch=1)
    onebit = dataclasses.replace(plain, compress="onebit", compress_after=100)
    plans = {name: estimate(work, cluster, lay) for name, lay in (
        ("plain", plain), ("onebit", onebit), ("onebit-zero1", dataclasses.replace(onebit, zero=1)),
        ("zeroone-zero1", dataclasses.replace(onebit, zero=1, compress="zeroone", compress_after=0)))}
    params = plans["plain"].comm_bytes["dp"] / (2 * 63 / 64 * 4)  # the fp32 padded buckets
    for name in ("onebit-zero1", "zeroone-zero1"):
        gathered = plans[name].comm_bytes["dp"] - plans["onebit"].comm_bytes["dp"]
        assert gathered == pytest.approx(63 / 64 * 4 * params, rel=1e-9)
        assert plans["onebit"].step_time_s < plans[name].step_time_s < plans["plain"].step_time_s
        states = plans[name].memory_breakdown["optimizer_states"]
        assert states == pytest.approx(plans["onebit"].memory_breakdown["optimizer_states"] / 64, rel=1e-6)
    grads = {name: plans[name].memory_breakdown["gradients"] for name in plans}
    assert grads["onebit-zero1"] - grads["onebit"] == pytest.approx(4 * cfg.num_params() * 63 / 64, rel=1e-6)
    assert grads["zeroone-zero1"] - grads["onebit"] == pytest.approx(4 * cfg.num_params(), rel=1e-6)


def test_the_search_offers_onebit_under_zero0_and_zero1_and_powersgd_under_zero0():
    """plan/search's compressed twins: each ZeRO-0 and ZeRO-1 layout of data parallelism (and
    pipelines) gets 1-bit Adam, each ZeRO-0 one PowerSGD too; none under ZeRO-2/3 or with tp."""
    import dataclasses
    from collections import Counter

    from strata.model.presets import get_preset
    from strata.plan.inputs import workload
    from strata.plan.search import layouts
    offered = list(layouts(workload(get_preset("llama-1b"), 64, 2048, "bf16"), 8, offload=False))
    kinds = Counter((lay.compress, lay.zero) for lay in offered if lay.compress != "none")
    assert set(kinds) == {("powersgd", 0), ("onebit", 0), ("onebit", 1)} and kinds["onebit", 1] > 0
    plain = [lay for lay in offered if lay.compress == "none" and lay.tp == lay.cp == 1 and lay.zero < 2
             and lay.dp > 1 and lay.dp_shard is None]
    twins = {dataclasses.replace(lay, compress="onebit", compress_after=1) for lay in plain}
    assert twins == {lay for lay in offered if lay.compress == "onebit"}


def test_parallel_autos_search_prices_the_users_compression():
    """--parallel auto keeps the user's --compress (train/auto.KEPT, with --offload and the rest):
    the search sets it on every candidate, so each is priced as it will run (its dp bytes the 1-bit
    rounds', not the uncompressed layout's), and what cannot run with it (tp, ZeRO-2/3) is not offered."""
    import dataclasses

    from strata.model.presets import get_preset
    from strata.plan.cost import estimate
    from strata.plan.inputs import build_cluster, workload
    from strata.plan.search import search
    from strata.rules.layout import Layout
    from strata.train.auto import KEPT
    kept = {name: getattr(Layout(), name) for name in KEPT} | {"compress": "onebit", "compress_after": 2}
    work, cluster = workload(get_preset("llama-1b"), 64, 2048, "bf16"), build_cluster("A100-80G", 1, 8, None, "ib-200")
    ranked, rejected = search(work, cluster, offload=False, compress=False, kept=kept)
    assert ranked and {(e.layout.compress, e.layout.compress_after, e.layout.tp) for e in ranked + rejected} == {
        ("onebit", 2, 1)}
    assert {e.layout.zero for e in ranked} == {0, 1}
    best = ranked[0]
    plain = estimate(work, cluster, dataclasses.replace(best.layout, compress="none", compress_after=0))
    assert best.comm_bytes["dp"] < plain.comm_bytes["dp"]
    assert len({e.layout for e in ranked + rejected}) == len(ranked + rejected)


def test_the_planner_prices_zeroone_between_variance_updates_and_its_flat_gradient():
    """0/1 Adam's steps that leave v alone send 1-bit Adam's two rounds (the planner prices those, a
    long run's steady state: the steps updating v are about kappa log2(T / kappa) of T), and its
    rank holds the flat fp32 gradient beside the two error buffers."""
    import dataclasses

    from strata.model.presets import get_preset
    from strata.plan.cost import estimate
    from strata.plan.inputs import build_cluster, workload
    from strata.rules.layout import Layout
    cfg = get_preset("llama-1b")
    work, cluster = workload(cfg, 512, 2048, "bf16"), build_cluster("A100-80G", 8, 8, None, "10gbe")
    onebit = Layout(dp=64, checkpointing="full", micro_batch=1, compress="onebit", compress_after=100)
    onebit_plan = estimate(work, cluster, onebit)
    zeroone_plan = estimate(work, cluster, dataclasses.replace(onebit, compress="zeroone", compress_after=0))
    assert zeroone_plan.comm_bytes["dp"] == onebit_plan.comm_bytes["dp"]
    assert zeroone_plan.exposed_comm_s["dp"] == onebit_plan.exposed_comm_s["dp"]
    flat = zeroone_plan.memory_breakdown["gradients"] - onebit_plan.memory_breakdown["gradients"]
    assert flat == pytest.approx(4 * cfg.num_params(), rel=1e-6)
    assert variance_updates(100_000, 16) < 16 * 14  # the whole steps of a long run: under 0.3% of them
