"""Data parallelism and ZeRO-1/2/3 against the single-process run, the ZeRO memory formulas and
the ring communication volumes (Rajbhandari et al. 2020)."""

import functools

import pytest
import torch
import torch.nn as nn

from strata.config import train_config
from strata.model.presets import get_preset
from strata.parallel.buckets import plan_buckets, shard_pieces
from strata.plan.cost import estimate
from strata.plan.inputs import build_cluster, workload
from strata.rules import buckets as bucket_rule
from strata.rules.constants import BUCKET_MB, MAX_IN_FLIGHT
from strata.rules.layout import Layout
from strata.train.trainer import train

from distributed import run_on_ranks

PSI = get_preset("tiny").num_params()  # 106,816
BASE = dict(model="tiny", seq_len=32, steps=10, progress=False, peak_flops=1e10, eval_batches=1,
            lr=3e-3, seed=5)
# (a) gradient accumulation with clipping active; (b) one micro-batch per rank, no clipping.
ACCUMULATE = dict(global_batch=8, micro_batch=1, grad_clip=0.5)
def SINGLE_MICRO(world): return dict(global_batch=world, micro_batch=1, grad_clip=0.0)  # noqa: E302


def aligned_elements(world, cfg=get_preset("tiny"), bucket_mb=BUCKET_MB):
    """Elements of the flat buffer ZeRO-0/1/2 lay a model's fp32 parameters out in on `world`
    ranks: the parameters and the alignment's padding (strata/rules/buckets.py)."""
    from strata.model.transformer import Transformer
    with torch.device("meta"):
        sizes = [p.numel() for p in reversed(list(Transformer(cfg).parameters()))]
    return sum(b.size for b in bucket_rule.plan_buckets(sizes, bucket_rule.bucket_elements(bucket_mb, 4), world,
                                                        aligned=True))


def padding_elements(world):
    """How far a rank's share of tiny's parameters can be from 1/world of them: the padding that
    the last rank's shards hold instead (ZeRO-3's units: up to world - 1 elements each; ZeRO-1/2's
    aligned buffer: all its padding, at most)."""
    return max((world - 1) * (get_preset("tiny").n_layers + 2), aligned_elements(world) - PSI)


def _summary(settings, keep_state=True):
    s = train(train_config(**{**BASE, **settings}), keep_state=keep_state)
    return {"losses": s["losses"], "state": s.get("state"), "record": s["records"][-1]}


@functools.lru_cache(maxsize=None)
def single_process(dtype, settings_key):
    return _summary({**dict(settings_key), "dtype": dtype})


def _both_settings_on_rank(world, zero, dtype):
    return [_summary({**settings, "dtype": dtype, "zero": zero})
            for settings in (ACCUMULATE, SINGLE_MICRO(world))]


@functools.lru_cache(maxsize=None)
def data_parallel(world, zero, dtype):
    return run_on_ranks(_both_settings_on_rank, world, world, zero, dtype, timeout=300)


@pytest.mark.parametrize("dtype,rtol", [("fp64", 1e-10), ("fp32", 1e-5)])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [2, 4])
def test_every_zero_stage_reproduces_the_single_process_run(world, zero, dtype, rtol):
    ranks = data_parallel(world, zero, dtype)
    for which, settings in enumerate((ACCUMULATE, SINGLE_MICRO(world))):
        reference = single_process(dtype, tuple(sorted(settings.items())))
        for rank in ranks:
            torch.testing.assert_close(rank[which]["losses"], reference["losses"], rtol=rtol, atol=0)
        for name, value in ranks[0][which]["state"].items():
            for rank in ranks[1:]:  # every rank ends with the same parameters
                assert torch.equal(rank[which]["state"][name], value), name
            torch.testing.assert_close(value, reference["state"][name], rtol=rtol * 100, atol=rtol)


# fp32 Adam: 4 bytes of weights, 4 of gradients, 8 of moments per parameter.
def zero_formula(zero, n):
    return {0: (4 * PSI, 4 * PSI, 8 * PSI), 1: (4 * PSI, 4 * PSI, 8 * PSI / n),
            2: (4 * PSI, 4 * PSI / n, 8 * PSI / n), 3: (4 * PSI / n, 4 * PSI / n, 8 * PSI / n)}[zero]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [2, 4])
def test_model_state_bytes_follow_the_zero_formulas(world, zero):
    ranks = data_parallel(world, zero, "fp32")
    padding_bytes = 4 * padding_elements(world)
    per_rank = [r[1]["record"]["model_state_breakdown"] for r in ranks]
    for kind, expected in zip(("params", "grads", "optimizer"), zero_formula(zero, world)):
        for states in per_rank:
            assert abs(states[kind] - expected) <= padding_bytes * (2 if kind == "optimizer" else 1), kind
        if expected < 4 * PSI * (2 if kind == "optimizer" else 1):  # sharded: the shards add up exactly
            assert sum(s[kind] for s in per_rank) == expected * world, kind
    total = sum(per_rank[0].values())
    formula = {0: 16 * PSI, 1: 8 * PSI + 8 * PSI / world, 2: 4 * PSI + 12 * PSI / world, 3: 16 * PSI / world}
    assert abs(total - formula[zero]) <= 4 * padding_bytes


BF16_LAYOUTS = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "bf16"), (2, "bf16"), (3, "bf16")]


def _bf16_state_breakdowns():
    return [train(train_config(**{**BASE, "steps": 1, "dtype": "bf16", "zero": zero, "gather_dtype": gather,
                                 "global_batch": 2, "micro_batch": 1}))["records"][-1]["model_state_breakdown"]
            for zero, gather in BF16_LAYOUTS]


def test_the_planner_counts_the_model_states_a_bf16_run_holds():
    """Under bf16 strata holds fp32 masters as the weights (or, with bf16 gathers under ZeRO-1/2,
    DeepSpeed's bf16 weights beside fp32 master shards): what the planner prices, kind by kind."""
    from strata.plan.memory import held_state_bytes
    padding_bytes = 4 * padding_elements(2)
    for (zero, gather), held in zip(BF16_LAYOUTS, run_on_ranks(_bf16_state_breakdowns, 2, timeout=300)[0]):
        planned = held_state_bytes(PSI, zero, 2, "mixed", "adamw", gather)
        for kind, expected in zip(("params", "grads", "optimizer"), (planned.weights, planned.grads, planned.optimizer)):
            assert abs(held[kind] - expected) <= 3 * padding_bytes, (zero, gather, kind, held[kind], expected)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [2, 4])
def test_communication_per_step_is_the_ring_minimum(world, zero):
    """The ring's 2Ψ(N-1)/N (3Ψ under ZeRO-3), Ψ the elements of the flat buffers the runtime moves:
    under ZeRO-0/1/2 to the byte, the alignment's padding included; ZeRO-3's units padded to a
    multiple of dp, a few elements each."""
    ranks = data_parallel(world, zero, "fp32")
    elements = PSI if zero == 3 else aligned_elements(world)
    volume = (3 if zero == 3 else 2) * elements * (world - 1) / world * 4  # bytes, fp32
    padding = 3 * (world - 1) * (get_preset("tiny").n_layers + 2) * 4 if zero == 3 else 0
    scalars = 64  # the loss and the squared gradient norm, reduced for logging and clipping
    for rank in ranks:
        by_op = rank[1]["record"]["comm_bytes_by_op"]
        assert volume <= sum(by_op.values()) <= volume + padding + scalars, by_op
        expected_ops = {0: {"all_reduce/dp"}, 1: {"reduce_scatter/dp", "all_gather/dp", "all_reduce/dp"},
                        2: {"reduce_scatter/dp", "all_gather/dp", "all_reduce/dp"},
                        3: {"reduce_scatter/dp", "all_gather/dp", "all_reduce/dp"}}[zero]
        assert set(by_op) == expected_ops


def test_data_parallel_sends_nothing_on_accumulation_micro_steps():
    ranks = data_parallel(2, 0, "fp32")
    # 4 micro-batches per rank, yet one all-reduce of the gradients per step
    by_op = ranks[0][0]["record"]["comm_bytes_by_op"]
    assert by_op["all_reduce/dp"] <= 2 * aligned_elements(2) * 1 / 2 * 4 + 64


def test_buckets_never_split_a_parameter_and_shards_partition_the_parameters():
    params = [nn.Parameter(torch.zeros(n)) for n in (5, 7, 3, 11, 2)]
    buckets, total = plan_buckets(params, bucket_elems=10, dp_size=4)
    assert [len(b.params) for b in buckets] == [1, 2, 1, 1]  # 5 | 7+3 | 11 | 2, in the given order
    for b in buckets:
        assert b.size % 4 == 0
        assert b.offsets[-1] + b.params[-1].numel() <= b.start + b.size
    owned = sorted((pc.start, pc.end) for r in range(4) for pc in shard_pieces(buckets, r, 4))
    covered = sum(e - s for s, e in owned)
    assert covered == sum(p.numel() for p in params) and total >= covered


def _resume_under_zero(tmp, zero, gather_dtype):
    common = dict(model="tiny", seq_len=32, steps=6, global_batch=4, micro_batch=1, zero=zero, seed=3,
                  progress=False, peak_flops=1e10, eval_batches=1, gather_dtype=gather_dtype,
                  dtype="bf16" if gather_dtype == "bf16" else "fp32")
    straight = train(train_config(**common))["losses"]
    train(train_config(**common, save=f"{tmp}/ck", save_every=3))
    resumed = train(train_config(**common, resume=f"{tmp}/ck/step_000003"))["losses"]
    return straight, resumed


@pytest.mark.parametrize("zero,gather_dtype", [(1, "fp32"), (3, "fp32"), (1, "bf16"), (2, "bf16"), (3, "bf16")])
def test_resume_under_zero_is_exact(tmp_path, zero, gather_dtype):
    # bf16 gathers: the checkpoint holds the fp32 masters, and the bf16 weights are cast from them again
    for straight, resumed in run_on_ranks(_resume_under_zero, 2, str(tmp_path), zero, gather_dtype, timeout=300):
        assert resumed == straight[3:]


def _launch_points(zero):
    """For each bucket's collective: how many parameters still had no gradient when it started."""
    from strata.train import trainer
    run = trainer.setup(train_config(model="tiny", seq_len=32, global_batch=2, micro_batch=1, zero=zero,
                                    bucket_mb=0.05, progress=False, peak_flops=1e10, eval_batches=1))
    parallel, points = run.parallel, []
    arrived = set()
    for p in parallel.params:
        p.register_post_accumulate_grad_hook(lambda p: arrived.add(id(p)))
    reductions = parallel.sharding.reductions
    launch = reductions._launch

    def recording_launch(bucket):  # runs inside the hook of the gradient that completed the bucket
        points.append(len(parallel.params) - len(arrived) - 1)
        launch(bucket)
    reductions._launch = recording_launch
    trainer.train_step(run, 0)
    return len(parallel.sharding.buckets), points


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_buckets_are_reduced_while_backward_still_runs(zero):
    for buckets, points in run_on_ranks(_launch_points, 2, zero, timeout=120):
        assert buckets > 3 and len(points) == buckets
        assert all(p > 0 for p in points[:-1]) and points[-1] == 0  # every bucket but the last overlaps


def _grads_after_an_accumulation_micro_step(zero):
    """Which parameters' .grad lies in the flat gradient buffer after a micro-batch that is not the last."""
    from strata.train import trainer
    run = trainer.setup(train_config(model="tiny", seq_len=32, global_batch=4, micro_batch=1, zero=zero,
                                    progress=False, peak_flops=1e10, eval_batches=1))
    inputs, targets = run.train_data.micro_batches(0, 1)[0]
    with run.parallel.backward(is_last_micro_batch=False):
        run.model(inputs, targets).backward()
    buffer = run.parallel.sharding.gradients.flat.untyped_storage().data_ptr()
    return [p.grad is not None and p.grad.untyped_storage().data_ptr() == buffer for p in run.parallel.params]


@pytest.mark.parametrize("zero", [0, 1])
def test_accumulated_gradients_live_in_the_buffer_alone(zero):
    # One copy of the gradients while micro-batches accumulate: none of autograd's beside the buffer.
    for in_buffer in run_on_ranks(_grads_after_an_accumulation_micro_step, 2, zero, timeout=120):
        assert in_buffer and all(in_buffer)


@pytest.mark.parametrize("world", [2, 4])
def test_zero3_counts_its_gathered_parameters_as_buffers_not_activations(world):
    """ZeRO-3 frees each unit's gathered parameters after its forward and gathers them again for
    the backward, so autograd's saved references to them hold no memory: the saved activations are
    those of ZeRO-0, and the gathered units are reported apart, as buffer_bytes: at least two of
    the largest unit (the one in use and the one prefetched), at most every unit gathered and its
    gradients staged."""
    zero0, zero3 = (data_parallel(world, zero, "fp32")[0][1]["record"] for zero in (0, 3))
    assert zero3["peak_activation_bytes"] == zero0["peak_activation_bytes"]
    assert "buffer_bytes" not in zero0
    largest = max(get_preset("tiny").unit_params())
    assert 2 * 4 * largest <= zero3["buffer_bytes"] <= 2 * 4 * PSI


def _zero2_staging_over_steps():
    """The staging buffers ZeRO-2 has allocated after each of three steps of two micro-batches."""
    from strata.train import trainer
    run = trainer.setup(train_config(model="tiny", seq_len=32, global_batch=8, micro_batch=2, zero=2,
                                    bucket_mb=0.05, progress=False, peak_flops=1e10, eval_batches=1))
    sharding, allocated = run.parallel.sharding, []
    for step in range(3):
        trainer.train_step(run, step)
        allocated.append(sharding.peak_buffer_bytes)
    return allocated, 4 * max(b.size for b in sharding.buckets), len(sharding.buckets)


def test_zero2_reuses_its_staging_buffers():
    """Six micro-batches reduce every bucket six times, from the buffers the first step allocated:
    no more than one filling and MAX_IN_FLIGHT reducing, however many buckets there are."""
    for allocated, bucket_bytes, buckets in run_on_ranks(_zero2_staging_over_steps, 2, timeout=120):
        assert buckets > MAX_IN_FLIGHT + 1
        assert 0 < allocated[0] <= (MAX_IN_FLIGHT + 1) * bucket_bytes
        assert allocated == [allocated[0]] * 3


@pytest.mark.parametrize("world", [2, 4])
def test_zero2_staging_is_the_buffers_the_planner_predicts(world):
    """tiny fits one 25 MB bucket: ZeRO-2 keeps one staging buffer of every fp32 gradient (padded
    and aligned, a multiple of dp shards of 64 elements), which the planner counts as buffers, to
    the element."""
    zero2 = data_parallel(world, 2, "fp32")[0][1]["record"]
    predicted = estimate(workload(get_preset("tiny"), world, 32, "fp32"), build_cluster("A100-80G", 1, world, None,
                                                                                         "ib-200"),
                         Layout(dp=world, zero=2)).memory_breakdown["buffers"]
    assert zero2["buffer_bytes"] == 4 * aligned_elements(world)
    assert predicted == zero2["buffer_bytes"]
