"""fp16 with dynamic loss scaling: an overflow skips the step on every rank alike, halves the scale,
leaves the weights untouched, and training goes on."""

import pytest
import torch

from strata.config import train_config
from strata.model.presets import get_preset
from strata.model.transformer import build_model
from strata.train.trainer import train

from distributed import run_on_ranks

BASE = dict(model="tiny", seq_len=32, micro_batch=2, global_batch=4, progress=False, peak_flops=1e10,
            eval_batches=1, dtype="fp16")


def _scaled_run(settings):
    s = train(train_config(**{**BASE, **settings, "steps": 8, "loss_scale": 2.0**24, "loss_scale_window": 3}))
    return [(r["skipped"], r["loss_scale"], r["skipped_steps"]) for r in s["records"]]


def test_fp16_overflow_is_skipped_on_every_rank_the_scale_halves_and_training_continues():
    # 2^24 overflows fp16 gradients of tiny: the first steps are skipped until the scale fits.
    # dp 2 with ZeRO-1: each rank checks only its shard of the gradients, so agreeing needs the all-reduce.
    ranks = run_on_ranks(_scaled_run, 2, dict(global_batch=8, zero=1), timeout=300)
    assert ranks[0] == ranks[1]
    records = ranks[0]
    assert records[0] == (True, 2.0**23, 1)
    previous = 2.0**24
    for skipped, scale, _ in records:
        if skipped:
            assert scale == previous / 2
        previous = scale
    assert not all(skipped for skipped, _, _ in records)
    assert records[-1][2] == sum(skipped for skipped, _, _ in records)


def test_a_skipped_step_leaves_the_weights_as_they_were():
    s = train(train_config(**BASE, steps=1, loss_scale=2.0**40, seed=4), keep_state=True)
    assert s["records"][0]["skipped"]
    initial = build_model(get_preset("tiny"), seed=4).state_dict()
    for name, value in s["state"].items():
        assert torch.equal(value, initial[name]), name


def _reduce_in(zero, reduce_dtype):
    s = train(train_config(**{**BASE, "dtype": "fp32"}, steps=4, zero=zero, reduce_dtype=reduce_dtype))
    by_op = s["records"][-1]["comm_bytes_by_op"]
    return s["losses"], by_op.get("all_reduce/dp", 0) if zero == 0 else by_op["reduce_scatter/dp"]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_bf16_gradient_reduction_halves_the_bytes_and_tracks_fp32(zero):
    fp32_losses, fp32_bytes = run_on_ranks(_reduce_in, 2, zero, "fp32", timeout=300)[0]
    bf16_losses, bf16_bytes = run_on_ranks(_reduce_in, 2, zero, "bf16", timeout=300)[0]
    loss = 8 if zero == 0 else 0  # ZeRO-0's all-reduce count includes the loss (an fp64 scalar)
    assert bf16_bytes - loss == (fp32_bytes - loss) / 2
    torch.testing.assert_close(bf16_losses, fp32_losses, rtol=1e-3, atol=0)


def _gathering_in(zero, gather_dtype):
    s = train(train_config(**{**BASE, "dtype": "bf16"}, steps=4, zero=zero, gather_dtype=gather_dtype), keep_state=True)
    return s["losses"], s["records"][-1]["comm_bytes_by_op"], {k: v.dtype for k, v in s["state"].items()}


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_bf16_gathers_halve_the_parameter_bytes_track_fp32_and_keep_fp32_masters(zero):
    fp32_losses, fp32_bytes, _ = run_on_ranks(_gathering_in, 2, zero, "fp32", timeout=300)[0]
    bf16_losses, bf16_bytes, saved = run_on_ranks(_gathering_in, 2, zero, "bf16", timeout=300)[0]
    assert bf16_bytes["all_gather/dp"] == fp32_bytes["all_gather/dp"] / 2
    assert bf16_bytes["reduce_scatter/dp"] == fp32_bytes["reduce_scatter/dp"]  # gradients still reduced in fp32
    assert set(saved.values()) == {torch.float32}  # what a checkpoint holds: the masters
    torch.testing.assert_close(bf16_losses, fp32_losses, rtol=2e-2, atol=0)
    assert bf16_losses != fp32_losses  # the layers did compute with bf16 weights


TRANSFERS = [(0, "fp32", "fp32"), (0, "bf16", "fp32"), (1, "fp32", "fp32"), (1, "bf16", "fp32"), (1, "bf16", "bf16"),
             (2, "fp32", "fp32"), (2, "fp32", "bf16"), (2, "bf16", "bf16"), (3, "fp32", "fp32"), (3, "fp32", "bf16"),
             (3, "bf16", "bf16")]


def _counted_dp_bytes():
    counted = {}
    for zero, reduce_dtype, gather_dtype in TRANSFERS:
        cfg = train_config(**{**BASE, "dtype": "bf16", "global_batch": 8}, steps=2, zero=zero,
                          reduce_dtype=reduce_dtype, gather_dtype=gather_dtype)
        by_op = train(cfg)["records"][-1]["comm_bytes_by_op"]
        counted[(zero, reduce_dtype, gather_dtype)] = sum(
            by_op.get(f"{op}/dp", 0) for op in ("all_reduce", "reduce_scatter", "all_gather"))
    return counted


def test_the_planner_prices_the_data_parallel_bytes_each_transfer_dtype_moves():
    # bf16 compute, 2 micro-batches per rank: ZeRO-2/3 reduce (and gather) twice, ZeRO-0/1 once
    from strata.config import layout_of
    from strata.plan.cost import estimate
    from strata.plan.inputs import build_cluster, workload
    counted = run_on_ranks(_counted_dp_bytes, 2, timeout=600)[0]
    work, cluster = workload(get_preset("tiny"), 8, 32, "bf16"), build_cluster("A100-80G", 1, 2, None, "ib-200")
    for (zero, reduce_dtype, gather_dtype), nbytes in counted.items():
        cfg = train_config(**{**BASE, "dtype": "bf16", "global_batch": 8}, zero=zero, reduce_dtype=reduce_dtype,
                          gather_dtype=gather_dtype)
        planned = estimate(work, cluster, layout_of(cfg, 2)).comm_bytes["dp"]
        scalars = 8 + (16 if zero else 0)  # the loss's fp64 all-reduce; the norm's two fp64 squares (sharded states)
        # what remains is the padding of flat buffers to a multiple of dp: a few elements
        assert nbytes - scalars == pytest.approx(planned, rel=1e-3), (zero, reduce_dtype, gather_dtype)


@pytest.mark.parametrize("dtype,advice,not_advised", [("bf16", "try fp32", "use bf16"), ("fp16", "use bf16", "fp32"),
                                                      ("fp32", "lower --lr", "bf16")])
def test_a_diverged_validation_loss_advises_a_precision_other_than_the_runs(monkeypatch, dtype, advice, not_advised):
    """A NaN validation loss under bf16 must not advise bf16 (issue 51)."""
    from types import SimpleNamespace

    from strata.train import trainer
    monkeypatch.setattr(trainer, "evaluate", lambda run: float("nan"))
    with pytest.raises(FloatingPointError) as stopped:
        trainer.validate_and_log(SimpleNamespace(cfg=SimpleNamespace(dtype=dtype)), None, 5)
    assert "step 5: the validation loss is nan" in str(stopped.value)
    assert advice in str(stopped.value) and not_advised not in str(stopped.value)
