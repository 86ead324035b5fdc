"""The asynchronous pipeline schedules, PipeDream-2BW and PipeDream: a run on P stages equals the
single-process run of the same weight-version rule (2BW: `--pp 1 --schedule 2bw`; PipeDream:
`--pp 1 --schedule pipedream --emulate-stages P`), alone and with dp2 x ZeRO-1; the versions each
stage stashes are counted; a resumed run continues bit for bit; the flushless schedule has no idle
time in steady state (simulated with unit costs)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from strata.config import train_config
from strata.model.presets import get_preset
from strata.rules.schedules import SCHEDULES, flushless, one_f_one_b, profile, segment, simulate
from strata.train.trainer import train

from distributed import run_on_ranks

BASE = dict(model="tiny", seq_len=32, steps=8, progress=False, peak_flops=1e10, eval_batches=1,
            lr=3e-3, seed=3, micro_batch=1, grad_clip=0.0)


def _settings(schedule: str, p: int) -> dict:
    """2BW: 8 micro-batches a step (m >= p); PipeDream: one (it updates after each). 4 stages need
    4 units of blocks, embedding and head: tiny's 2 blocks and its inputs and outputs."""
    return dict(schedule=schedule, global_batch=1 if SCHEDULES[schedule].update_per_micro_batch else 8)


def _run(settings: dict, keep_state: bool = False) -> dict:
    s = train(train_config(**{**BASE, **settings}), keep_state=keep_state)
    return {"losses": s["losses"], "val": [v for _, v in s["val_losses"]], "records": s["records"],
            "state": s.get("state")}


@functools.lru_cache(maxsize=None)
def reference(schedule: str, p: int, dtype: str) -> dict:
    """The single-process run of the rule a P-stage run follows."""
    emulate = p if SCHEDULES[schedule].update_per_micro_batch else 1  # PipeDream's delays depend on p
    return _run({**_settings(schedule, p), "dtype": dtype, "emulate_stages": emulate})


def _pipelined(schedule: str, p: int, dtype: str, dp: int = 1, zero: int = 0) -> dict:
    return _run({**_settings(schedule, p), "dtype": dtype, "pp": p, "dp": dp, "zero": zero,
                 "global_batch": dp if SCHEDULES[schedule].update_per_micro_batch else 8})


# --- the schedule as data ---------------------------------------------------------------------------
@pytest.mark.parametrize("p,m", [(2, 1), (2, 3), (4, 1), (4, 2), (4, 8)])
def test_segments_between_a_fill_and_a_drain_are_one_1f1b_over_all_their_micro_batches(p, m):
    steps = 5
    assert flushless(p, m, steps) == one_f_one_b(p, steps * m)
    # a pause after step 2 (an evaluation): the stream stops at 3m, the step before it drains
    stop = 3 * m
    for r in range(p):
        before = [a for t in range(3) for a in segment(p, m, r, t, t == 0, stop)]
        assert before == one_f_one_b(p, stop)[r]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 1), (8, 2)])
def test_a_flushless_step_has_no_bubble_in_steady_state_where_1f1b_has_p_minus_1_slots(p, m):
    assert profile("2bw", p, m).bubble_slots == 0
    assert profile("pipedream", p, m).bubble_slots == 0
    assert profile("1f1b", p, m).bubble_slots == pytest.approx(p - 1)
    # every rank busy all the time between the fill and the drain: one more step adds only its work
    costs = {"F": 1.0, "B": 2.0}
    added = simulate(flushless(p, m, 4), p, costs).makespan - simulate(flushless(p, m, 3), p, costs).makespan
    assert added == 3.0 * m
    assert profile("2bw", p, m).in_flight == tuple(float(p - r) for r in range(p))


# --- the runs ----------------------------------------------------------------------------------------
ASYNC = ("2bw", "pipedream", "pipedream-vs")


def _every(p: int) -> dict:
    return {schedule: _pipelined(schedule, p, "fp64") for schedule in ASYNC}


@pytest.mark.parametrize("p", [2, 4])
def test_p_stages_equal_the_single_process_run_of_their_rule_in_fp64(p):
    ranks = run_on_ranks(_every, p, p, timeout=600)
    for schedule in ASYNC:
        expected = reference(schedule, p, "fp64")
        for rank in ranks:  # every rank reports the last stage's loss
            torch.testing.assert_close(rank[schedule]["losses"], expected["losses"], rtol=1e-10, atol=0)
            torch.testing.assert_close(rank[schedule]["val"], expected["val"], rtol=1e-10, atol=0)
        synchronous = _run({**_settings(schedule, p), "dtype": "fp64", "schedule": "1f1b"})
        # stale weights change the run, far past the 1e-10 the runs are compared at
        assert abs(synchronous["losses"][-1] - expected["losses"][-1]) > 1e-6
        # weight versions stashed, counted after each update: 2 on every stage for 2BW, p - i on stage i
        for stage, rank in enumerate(ranks):
            counts = [r["weight_versions"][0] for r in rank[schedule]["records"]]
            want = {"2bw": 2, "pipedream": p - stage, "pipedream-vs": p}[schedule]
            assert max(counts) == want, (schedule, stage, counts)
            last = rank[schedule]["records"][-1]
            assert last["weight_version_bytes"][0] == want * last["model_state_breakdown"]["params"]
            # the planner's stashed versions for this stage: the same elements (it prices fp32, 4 bytes)
            predicted = _planned_versions(schedule, p, stage)
            assert predicted / 4 == last["weight_version_bytes"][0] / 8  # fp64 run: 8 bytes an element


def _planned_versions(schedule: str, p: int, stage: int) -> float:
    from strata.plan.cost import _terms, stage_loads
    from strata.plan.inputs import build_cluster, workload
    from strata.plan.rank_memory import rank_memory
    from strata.rules.layout import Layout
    model = get_preset("tiny")
    work = workload(model, _settings(schedule, p)["global_batch"], 32, "fp32")
    layout = Layout(pp=p, micro_batch=1, schedule=schedule)
    terms = _terms(work, build_cluster("A100-80G", 1, p, None, "ib-200"), layout, 1.0)
    load = stage_loads(model, p, 1, 32)[stage]
    return rank_memory(work, layout, terms, stage, load)["weight_versions"]


def _composed(schedule: str, extra: dict) -> dict:
    return _pipelined(schedule, 2, "fp64", dp=extra.get("dp", 1), zero=extra.get("zero", 0))["losses"] \
        if set(extra) <= {"dp", "zero"} else \
        _run({**_settings(schedule, 2), "dtype": "fp64", "pp": 2, **extra})["losses"]


COMPOSED = [("2bw", dict(dp=2, zero=1)), ("pipedream", dict(dp=2, zero=1)), ("2bw", dict(dp=2, zero=0)),
            ("2bw", dict(tp=2, sequence_parallel=True)), ("2bw", dict(model="tiny-gpt2")),
            ("pipedream", dict(checkpointing="full"))]


@pytest.mark.parametrize("schedule,extra", COMPOSED, ids=[f"{s}-{'-'.join(map(str, e.values()))}" for s, e in COMPOSED])
def test_composed_layouts_equal_the_single_process_rule(schedule, extra):
    """dp2 x pp2 with ZeRO-1 (and ZeRO-0), tp2 x pp2 with sequence parallelism, a tied embedding
    whose two copies, on the first and the last stage, compute with the same version, and activation
    checkpointing, whose recomputation in backward must see the forward's version."""
    world = 2 * extra.get("dp", 1) * extra.get("tp", 1)
    ranks = run_on_ranks(_composed, world, schedule, extra, timeout=600)
    settings = {**_settings(schedule, 2), "dtype": "fp64", "model": extra.get("model", "tiny"),
                "emulate_stages": 2 if schedule == "pipedream" else 1}
    if schedule == "pipedream" and extra.get("dp", 1) == 2:  # a step: a micro-batch per dp rank, here one of both
        settings.update(global_batch=2, micro_batch=2)
    expected = _run(settings)
    for rank in ranks:
        torch.testing.assert_close(rank, expected["losses"], rtol=1e-10, atol=0)


def test_the_planner_offers_asynchronous_schedules_only_when_allowed():
    from strata.plan.inputs import build_cluster, workload
    from strata.plan.search import search
    work = workload(get_preset("llama-7b"), 256, 2048, "bf16")
    cluster = build_cluster("A100-80G", 2, 8, None, "ib-200")
    plain, _ = search(work, cluster, offload=False)
    assert not any(SCHEDULES[e.layout.schedule].asynchronous for e in plain)
    allowed, _ = search(work, cluster, offload=False, allow_async=True)
    flushless = [e for e in allowed if SCHEDULES[e.layout.schedule].asynchronous]
    assert flushless and all(e.bubble == 0 for e in flushless)
    by_layout = {e.layout: e for e in allowed}
    compared = 0
    for e in flushless:  # the same layout under 1F1B: a bubble, and no stashed versions
        same = by_layout.get(dataclasses.replace(e.layout, schedule="1f1b"))
        if same is not None and e.layout.schedule == "2bw":
            assert same.bubble > 0 and e.step_time_s < same.step_time_s
            assert e.memory_breakdown["weight_versions"] > 0 and "weight_versions" not in same.memory_breakdown
            compared += 1
    assert compared > 10


# --- resume ------------------------------------------------------------------------------------------
def _resumed(schedule: str, save: str) -> dict:
    settings = {**_settings(schedule, 2), "dtype": "fp32", "pp": 2}
    whole = _run({**settings, "save": save, "save_every": 4})
    again = _run({**settings, "resume": f"{save}/step_000004"})
    return {"whole": whole["losses"], "again": again["losses"]}


@pytest.mark.parametrize("schedule", ["2bw", "pipedream"])
def test_a_resumed_run_continues_bit_for_bit_and_under_one_process(schedule, tmp_path):
    ranks = run_on_ranks(_resumed, 2, schedule, str(tmp_path / "ckpt"), timeout=600)
    for rank in ranks:
        assert rank["again"] == rank["whole"][4:]  # bit-identical
    # the same checkpoint under one process (the rule's reference layout): the same losses (fp32)
    settings = {**_settings(schedule, 2), "dtype": "fp32",
                "emulate_stages": 2 if schedule == "pipedream" else 1}
    one = _run({**settings, "resume": str(tmp_path / "ckpt" / "step_000004")})
    torch.testing.assert_close(one["losses"], ranks[0]["whole"][4:], rtol=1e-5, atol=0)


def test_zero0_optimizer_targets_share_the_storage_but_not_the_version_counter_and_drop_their_gradients():
    """What lets weight stashing work under ZeRO-0: the optimizer's in-place update leaves the
    parameter's autograd version counter (which in-flight graphs check) alone, and the targets let
    go of the gradients when the parameters do."""
    from strata.parallel.data import DataParallelSettings
    from strata.parallel.gradients import Replicate
    param = torch.nn.Parameter(torch.ones(4, 4))
    sharding = Replicate([param], DataParallelSettings())
    sharding.separate_optimizer_targets()
    (target, _, _, _), = sharding.optimizer_pieces()
    y = (param * param).sum()  # saves the parameter for backward
    param.grad = torch.full((4, 4), 2.0)
    sharding.prepare_step()
    torch.optim.SGD([target], lr=0.5).step()
    assert torch.equal(param.detach(), torch.zeros(4, 4))  # the same storage, updated
    y.backward()  # the saved parameter's version counter was not bumped: no error
    sharding.zero_grad()
    assert param.grad is None and target.grad is None
