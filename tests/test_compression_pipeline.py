"""PowerSGD beside a pipeline (--compress powersgd --pp 2, ZeRO-0): each stage compresses its own
parameters' gradients over its dp group after the schedule, a matrix's first Q drawn from --seed and
its name, so that pp2 x dp2 follows the dp-only rule of tests/test_compression.py matrix by matrix:
equal to it, and to the dp2 compressed run, in fp64 to 1e-10; a tied embedding's two copies (first
and last stage) stay identical; a stage's step all-reduces the formula's elements over its own
parameters; what stays refused is one line."""

from __future__ import annotations

import pytest
import torch
from test_compression import AFTER, BASE, COMPRESSED, RANK, RANKS, _step_bytes, single_process_rule

from strata.config import train_config
from strata.rules.compression import powersgd_elements
from strata.train import trainer

from cli_runner import assert_refused_in_one_line, run_strata
from distributed import assert_compressed_runs_follow_the_rule, run_on_ranks

PIPELINE = dict(pp=2, nproc=2 * RANKS)


def _losses(settings: dict) -> list[float]:
    return trainer.train(train_config(**{**BASE, **settings}))["losses"]


def _final(settings: dict) -> dict:
    """The losses, the final full model (gathered), and this stage's copy of the tied embedding
    with whether this is the last stage (which keeps the outputs: its head reads the copy)."""
    summary = trainer.train(train_config(**{**BASE, **settings}), keep_state=True)
    model = summary["model"]
    tied = model.tied_weight()
    return {"losses": summary["losses"], "state": summary["state"], "last": model.final_norm is not None,
            "tied": tied.detach().clone() if tied is not None else None}


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zb", 1)])
def test_pp2_dp2_follows_the_single_process_rule_in_fp64(schedule, v):
    """Every synchronous schedule: the stages compress after it, whatever order it ran backward in."""
    reference = single_process_rule()
    plain = run_on_ranks(_losses, RANKS, {})[0]
    compressed = run_on_ranks(_losses, 2 * RANKS, {**COMPRESSED, **PIPELINE, "schedule": schedule, "virtual_stages": v})
    assert_compressed_runs_follow_the_rule(compressed, reference, plain, AFTER)


def test_a_tied_embeddings_copies_stay_identical_and_equal_the_dp_run():
    """tiny-gpt2 (tied): the stages' copies' gradients are summed over the embedding group, then
    each stage compresses its copy with the same Q and keeps the same error: the copies are equal
    after every compressed step, and the run equals the rule and the dp2 compressed run (1e-10)."""
    gpt2 = dict(model="tiny-gpt2")
    reference = single_process_rule(**gpt2)
    plain = run_on_ranks(_losses, RANKS, gpt2)[0]
    flat = run_on_ranks(_final, RANKS, {**gpt2, **COMPRESSED})
    piped = run_on_ranks(_final, 2 * RANKS, {**gpt2, **COMPRESSED, **PIPELINE})
    assert_compressed_runs_follow_the_rule([r["losses"] for r in piped + flat], reference, plain, AFTER)
    for rank in piped:
        for name, tensor in flat[0]["state"].items():
            torch.testing.assert_close(rank["state"][name], tensor, rtol=1e-10, atol=1e-12, msg=name)
    firsts = [r["tied"] for r in piped if not r["last"]]
    lasts = [r["tied"] for r in piped if r["last"]]
    assert len(firsts) == len(lasts) == RANKS
    for first, last in zip(firsts, lasts):
        assert torch.equal(first, last)


def test_a_stages_compressed_step_all_reduces_the_formulas_elements_over_its_parameters():
    """fp64, dp 2 (a ring all-reduce sends 2(N-1)/N of its bytes): what a stage's compressed step
    sends over dp beyond its uncompressed steps' padded buffer is the P and Q rounds of
    rules/compression.powersgd_elements over the stage's own parameters (tiny-gpt2: the last
    stage's tied copy among them); the rest (the loss) is the same on every step."""
    ring = 2 * (RANKS - 1) / RANKS * 8
    stages = run_on_ranks(_step_bytes, 2 * RANKS, {**COMPRESSED, **PIPELINE, "model": "tiny-gpt2"})
    assert len({tuple(rank["shapes"]) for rank in stages}) == 2  # two stages, each its own parameters
    for rank in stages:
        first, second = powersgd_elements(rank["shapes"], RANK)
        rest = rank["sent"][0] - ring * rank["total"]
        assert rank["sent"][:AFTER] == [rank["sent"][0]] * AFTER
        assert rank["sent"][AFTER] == ring * (first + second) + rest
        assert first + second < rank["total"]


@pytest.mark.parametrize("flags,needle", [
    (["--nproc", "4", "--pp", "2", "--compress", "onebit", "--compress-after", "1", "--schedule", "2bw"],
     "--compress onebit: not with schedule 2bw"),
    (["--nproc", "4", "--pp", "2", "--compress", "powersgd", "--schedule", "2bw"],
     "--compress powersgd: not with schedule 2bw"),
    (["--nproc", "8", "--pp", "2", "--tp", "2", "--compress", "powersgd"],
     "--compress powersgd: runs with data parallelism alone for now (tp and cp 1"),
])
def test_what_stays_refused_beside_a_pipeline_is_one_line(flags, needle):
    result = run_strata("train", "--model", "tiny", "--steps", "1", "--micro-batch", "1", *flags)
    assert_refused_in_one_line(result, needle)


# --- the planner prices it --------------------------------------------------------------------------
def test_the_planner_prices_a_stages_rounds_all_exposed_and_searches_them():
    """1B on 8 nodes of 8 A100s over 10 GbE, dp 16 x pp 4: a stage's data-parallel bytes fall by the
    two rounds' share (the model's, applied to the stage's parameters), and both rounds come after
    the schedule: all exposed, where dp alone hides the P rounds behind backward. `strata plan`
    searches PowerSGD beside a pipeline (and 1-bit Adam: tests/test_onebit_pipeline.py)."""
    import dataclasses

    from strata.model.presets import get_preset
    from strata.plan.cost import estimate
    from strata.plan.inputs import build_cluster, workload
    from strata.plan.memory import powersgd_fractions
    from strata.plan.search import search
    from strata.rules.layout import Layout
    cfg = get_preset("llama-1b")
    work, cluster = workload(cfg, 512, 2048, "bf16"), build_cluster("A100-80G", 8, 8, None, "10gbe")
    plain = Layout(dp=16, pp=4, checkpointing="full", micro_batch=1)
    compressed = dataclasses.replace(plain, compress="powersgd", compress_rank=4)
    a, b = estimate(work, cluster, plain), estimate(work, cluster, compressed)
    p_share, q_share, _ = powersgd_fractions(cfg, 4)
    assert b.comm_bytes["dp"] == pytest.approx(a.comm_bytes["dp"] * (p_share + q_share), rel=1e-3)
    assert b.exposed_comm_s["dp"] == pytest.approx(b.comm_seconds["dp"], rel=1e-12)
    flat = estimate(work, cluster, dataclasses.replace(compressed, dp=64, pp=1))
    assert flat.exposed_comm_s["dp"] < flat.comm_seconds["dp"]
    ranked, _ = search(work, cluster, offload=False)
    piped = {e.layout.compress for e in ranked if e.layout.pp > 1}
    assert {"powersgd", "onebit"} <= piped
