"""ZeRO-0/1/2's flat buffers aligned (issue 53, item 3; strata/rules/buckets.py): every parameter's
view starts on a multiple of PARAM_ALIGN_ELEMENTS, every bucket on a multiple of
BUCKET_ALIGN_ELEMENTS and every rank's shard of it on a multiple of PARAM_ALIGN_ELEMENTS, counted in
the runtime's buffers; the collectives move the padded buckets, which the planner prices to the
byte; and the runs still reproduce the single-process one (fp64, 1e-10).

The model is tiny with widths that are no multiple of 64 (d_model 40, d_ff 72, a 251-token
vocabulary): packed back to front, most of its parameters would start misaligned."""

import dataclasses

import pytest
import torch

from strata.config import train_config
from strata.distributed import comm
from strata.model.presets import PRESETS, get_preset
from strata.model.transformer import Transformer
from strata.parallel.buckets import bucket_elements, plan_buckets, shard_pieces
from strata.plan.cost import estimate
from strata.plan.inputs import build_cluster, workload
from strata.rules.constants import BUCKET_ALIGN_ELEMENTS, PARAM_ALIGN_ELEMENTS
from strata.rules.layout import Layout
from strata.train import trainer
from strata.train.trainer import train

from distributed import run_on_ranks

ODD = dataclasses.replace(get_preset("tiny"), d_model=40, d_ff=72, vocab_size=251)  # 47,160 parameters
BASE = dict(model="tiny-odd", seq_len=16, micro_batch=1, progress=False, eval_batches=1, peak_flops=1e10,
            device="cpu", bucket_mb=0.02)  # 5,242 fp32 elements a bucket: a dozen buckets


def _params_back_to_front():
    with torch.device("meta"):
        return list(reversed(list(Transformer(ODD).parameters())))


def _offset(view: torch.Tensor, buffer: torch.Tensor) -> int:
    """Where a tensor starts in a flat buffer, in elements, from their addresses."""
    assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    return (view.data_ptr() - buffer.data_ptr()) // buffer.element_size()


def _layout_and_traffic(zero: int) -> dict:
    """This rank's buffers after one step under `zero`: each bucket's start and every rank's shard
    start, and measured from the tensors' addresses the start of every parameter's view, gradient
    view and optimizer piece (and its gradient) in its flat buffer; and the bytes the step moved."""
    PRESETS["tiny-odd"] = ODD  # this rank's process only
    world = torch.distributed.get_world_size()
    run = trainer.setup(train_config(**BASE, global_batch=world, zero=zero, dtype="fp32"))
    comm.counter.reset()
    trainer.train_step(run, 0)
    sharding = run.parallel.sharding
    out = {"bucket_starts": [b.start for b in sharding.buckets], "bucket_sizes": [b.size for b in sharding.buckets],
           "shard_starts": [b.shard(r, world)[0] for b in sharding.buckets for r in range(world)],
           "by_op": comm.counter.by_op()}
    if zero in (0, 1):  # the gradient buffer the buckets are reduced from
        grads = sharding.gradients
        out["grad_views"] = [_offset(view, grads.flat) for view in grads.views.values()]
    if zero in (1, 2):  # the parameters in one flat buffer, the optimizer's pieces of this rank's shards
        out["param_views"] = [_offset(p, sharding.param_buffer) for p in sharding.params]
        pieces = [tensor for tensor, _, _, _ in sharding.optimizer_pieces()]
        out["pieces"] = [_offset(t, sharding.param_buffer) for t in pieces]
        shard_grads = sharding.grad_buffer if zero == 1 else sharding.shard_grad_buffer
        out["piece_grads"] = [_offset(t.grad, shard_grads) for t in pieces]
    run.parallel.close()
    comm.close_streams()
    return out


def _every_stage() -> dict:
    return {zero: _layout_and_traffic(zero) for zero in (0, 1, 2)}


@pytest.fixture(scope="module")
def layouts():
    """{world: {zero: what rank 0 saw}} on 2, 3 and 4 ranks."""
    return {world: run_on_ranks(_every_stage, world, timeout=300)[0] for world in (2, 3, 4)}


def test_packed_the_models_parameters_would_start_misaligned():
    """What makes the tests below able to fail: without alignment, most offsets are not multiples."""
    buckets, _ = plan_buckets(_params_back_to_front(), bucket_elements(BASE["bucket_mb"], torch.float32), 4)
    offsets = [offset for b in buckets for offset in b.offsets]
    assert sum(offset % PARAM_ALIGN_ELEMENTS != 0 for offset in offsets) > len(offsets) // 2


def test_on_one_rank_the_runtimes_layout_is_aligned():
    """dp 1 (one process reduces nothing; its buckets are still laid out): the runtime's own
    functions over the model's parameters."""
    params = _params_back_to_front()
    buckets, total = plan_buckets(params, bucket_elements(BASE["bucket_mb"], torch.float32), 1, aligned=True)
    assert len(buckets) > 6 and sum(len(b.params) for b in buckets) == len(params) == 21
    assert all(b.start % BUCKET_ALIGN_ELEMENTS == 0 for b in buckets)
    assert all(offset % PARAM_ALIGN_ELEMENTS == 0 for b in buckets for offset in b.offsets)
    assert all(pc.shard_index % PARAM_ALIGN_ELEMENTS == 0 and pc.start % PARAM_ALIGN_ELEMENTS == 0
               for pc in shard_pieces(buckets, 0, 1) if pc.start == pc.offset)
    assert total % BUCKET_ALIGN_ELEMENTS == 0


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_every_view_bucket_and_shard_starts_aligned_in_the_runtimes_buffers(layouts, world, zero):
    seen = layouts[world][zero]
    assert len(seen["bucket_starts"]) > 6
    assert all(start % BUCKET_ALIGN_ELEMENTS == 0 for start in seen["bucket_starts"])
    assert all(size % (world * PARAM_ALIGN_ELEMENTS) == 0 for size in seen["bucket_sizes"])
    assert all(start % PARAM_ALIGN_ELEMENTS == 0 for start in seen["shard_starts"])
    counted = {key: seen[key] for key in ("grad_views", "param_views", "pieces", "piece_grads") if key in seen}
    assert counted and all(len(counted[key]) == 21 for key in ("grad_views", "param_views") if key in counted)
    for key, offsets in counted.items():
        assert offsets and all(offset % PARAM_ALIGN_ELEMENTS == 0 for offset in offsets), (key, offsets)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_the_collectives_move_the_padded_buckets_which_the_planner_prices(layouts, world, zero):
    """The ring's volume of every padded bucket, counted; the planner's data-parallel bytes are the
    same (the loss's and the norm's few-byte sums aside)."""
    seen, ring = layouts[world][zero], (world - 1) / world
    padded = sum(seen["bucket_sizes"])
    assert padded > sum(p.numel() for p in _params_back_to_front())
    by_op = seen["by_op"]
    if zero == 0:
        moved, expected = by_op["all_reduce/dp"], 2 * ring * padded * 4
        assert expected <= moved <= expected + 64, by_op
    else:
        moved = by_op["reduce_scatter/dp"] + by_op["all_gather/dp"]
        assert moved == pytest.approx(2 * ring * padded * 4, rel=1e-12), by_op
    work = dataclasses.replace(workload(ODD, world, BASE["seq_len"], "fp32"), bucket_mb=BASE["bucket_mb"])
    planned = estimate(work, build_cluster("A100-80G", 1, world, None, "ib-200"),
                       Layout(dp=world, zero=zero, micro_batch=1)).comm_bytes["dp"]
    assert planned == pytest.approx(2 * ring * padded * 4, rel=1e-12)


# --- the padded layout reproduces the single-process run ---------------------------------------------
EXACT = dict(global_batch=6, grad_clip=0.5, steps=4, lr=3e-3, seed=5, dtype="fp64")  # 6 micro-batches, clipped


def _odd_runs() -> dict:
    PRESETS["tiny-odd"] = ODD
    out = {}
    for zero in (0, 1, 2):
        summary = train(train_config(**BASE, **EXACT, zero=zero), keep_state=True)
        out[zero] = (summary["losses"], summary["state"])
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_aligned_buckets_reproduce_the_single_process_run(monkeypatch, world):
    monkeypatch.setitem(PRESETS, "tiny-odd", ODD)
    reference = train(train_config(**BASE, **EXACT), keep_state=True)
    for rank in run_on_ranks(_odd_runs, world, timeout=300):
        for zero, (losses, state) in rank.items():
            torch.testing.assert_close(losses, reference["losses"], rtol=1e-10, atol=0)
            for name, value in state.items():
                torch.testing.assert_close(value, reference["state"][name], rtol=1e-8, atol=1e-10, msg=name)
