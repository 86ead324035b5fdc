"""ZeRO-2 and ZeRO-3 under a pipeline (issue 56): pp2 x dp2 on 4 ranks reproduces one process in fp64
to 1e-10 (1F1B, GPipe, interleaved, and zero-bubble for ZeRO-2; ZeRO-3 gathering per micro-batch and with its units kept
gathered through the schedule, --no-reshard-after-forward; a tied embedding); the bytes each rank
counts per group equal the formula of what the runtime issues, and `strata plan`'s; a run saved
under pp2 x dp2 ZeRO-3 resumes on one process; bf16 gathers run with a pipeline; what stays refused
is one line."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from strata.config import train_config
from strata.distributed import comm
from strata.train import trainer

from cli_runner import assert_refused_in_one_line, run_strata
from distributed import run_on_ranks

BASE = dict(seq_len=16, steps=3, progress=False, peak_flops=1e10, eval_batches=1, lr=3e-3, seed=5, micro_batch=1,
            dtype="fp64", n_layers=4, global_batch=8)  # m = 4 micro-batches per dp rank, 2 blocks per stage
PIPELINE = dict(pp=2, dp=2)
CASES = [  # (model, zero, schedule, reshard_after_forward); tiny-gpt2 ties its embedding (and its head's copy)
    ("tiny", 3, "1f1b", True), ("tiny", 3, "1f1b", False), ("tiny", 3, "interleaved", True),
    ("tiny", 3, "interleaved", False), ("tiny", 2, "1f1b", True), ("tiny", 2, "interleaved", True), ("tiny", 2, "zb", True),
    ("tiny-gpt2", 3, "gpipe", True), ("tiny-gpt2", 3, "interleaved", False), ("tiny-gpt2", 2, "1f1b", True),
]
# A key projection's bias has no gradient in exact arithmetic (softmax ignores a shift shared by
# every key), so its value after Adam is rounding noise amplified to +-lr per step, different in any
# other order of the same sums (ZeRO-1 under a pipeline differs from one process alike): not compared.
NO_GRADIENT = ".attn.wk.bias"


def _settings(case: tuple) -> dict:
    model, zero, schedule, reshard = case
    return {"model": model, "zero": zero, "schedule": schedule, "virtual_stages": 2 if schedule == "interleaved" else 1,
            "reshard_after_forward": reshard}


def _trained(settings: list[dict]) -> list[tuple[list[float], dict]]:
    out = []
    for each in settings:
        summary = trainer.train(train_config(**{**BASE, **PIPELINE, **each}), keep_state=True)
        out.append((summary["losses"], {k: v.cpu() for k, v in summary["state"].items()}))
    return out


@functools.lru_cache(maxsize=None)
def _pipelined() -> list:
    return run_on_ranks(_trained, 4, [_settings(case) for case in CASES], timeout=600)


@functools.lru_cache(maxsize=None)
def _single_process(model: str) -> tuple[list[float], dict]:
    summary = trainer.train(train_config(**{**BASE, "model": model}), keep_state=True)
    return summary["losses"], summary["state"]


@pytest.mark.parametrize("case", CASES, ids=[f"{m}-zero{z}-{s}-{'reshard' if r else 'kept'}" for m, z, s, r in CASES])
def test_zero_2_and_3_under_pp2_x_dp2_reproduce_one_process_in_fp64(case):
    losses, state = _single_process(case[0])
    for rank in _pipelined():
        got_losses, got_state = rank[CASES.index(case)]
        torch.testing.assert_close(got_losses, losses, rtol=1e-10, atol=0)
        assert set(got_state) == set(state)
        for name, value in state.items():
            if NO_GRADIENT not in name:
                torch.testing.assert_close(got_state[name], value, rtol=1e-10, atol=1e-12, msg=name)


# --- counted bytes against the formula and the planner ------------------------------------------------
COUNTED = [(3, True), (3, False), (2, True)]  # (zero, reshard_after_forward)


def _step_bytes(settings: list[dict]) -> list[dict]:
    """One step of each: the bytes this rank sent by (op, group), and the padded elements of what
    ZeRO gathers and reduce-scatters on this stage (its units, or its buckets)."""
    out = []
    for each in settings:
        run = trainer.setup(train_config(**each))
        comm.counter.reset()
        trainer.train_step(run, 0)
        sharding = run.parallel.sharding
        sizes = [u.bucket.size for u in sharding.units] if run.parallel.stage == 3 else \
            [b.size for b in sharding.buckets]
        out.append({"sent": dict(comm.counter.bytes_sent), "elements": sum(sizes),
                    "pp_rank": dist.get_rank(run.pp_group), "params": sum(p.numel() for p in run.model.parameters())})
        run.parallel.close()
        comm.close_streams()
    return out


def _counted_settings(zero: int, reshard: bool) -> dict:
    return {**BASE, **PIPELINE, "model": "tiny", "dtype": "fp32", "zero": zero, "reshard_after_forward": reshard,
            "bucket_mb": 25.0, "steps": 1}


@pytest.mark.parametrize("zero,reshard", COUNTED)
def test_the_bytes_each_rank_counts_per_group_are_the_formula_and_the_planners(zero, reshard):
    """fp32, m = 4: ZeRO-3 gathering per micro-batch moves 2m gathers and m reduce-scatters of the
    stage's units, kept gathered 1 and 1; ZeRO-2 one reduce-scatter of its buckets after the schedule
    and one gather of the updated shards; each (N-1)/N of the padded elements x 4 bytes, N = 2. The
    planner's data-parallel bytes for each stage (its loads, plan/stages.py) are the same (tiny's
    units need no padding over 2 ranks, and the planner pads the buckets as the runtime does)."""
    from strata.model.presets import get_preset
    from strata.plan.buckets import collective_parts
    from strata.plan.data_parallel import data_parallel_seconds
    from strata.plan.inputs import build_cluster
    from strata.plan.stages import stage_loads
    from strata.rules.layout import Layout
    ranks = _counted()[COUNTED.index((zero, reshard))]
    m, ring = 4, (2 - 1) / 2
    gathers, scatters = (1, 1) if zero == 2 or not reshard else (2 * m, m)
    cfg = get_preset("tiny").with_overrides(n_layers=4)
    lay = Layout(dp=2, pp=2, zero=zero, reshard_after_forward=reshard, micro_batch=1)
    cluster = build_cluster("A100-80G", 1, 4, None, "ib-200")
    loads = stage_loads(cfg, 2, 1, 16)
    for rank in ranks:
        sent, elements = rank["sent"], rank["elements"]
        assert sent[("all_gather", "dp")] == gathers * ring * elements * 4
        assert sent[("reduce_scatter", "dp")] == scatters * ring * elements * 4
        load = loads[rank["pp_rank"]]
        assert load.params == rank["params"]  # the planner's stage holds what the rank holds
        parts = collective_parts(cfg, lay, load.layers, load.first, load.last, None, load.params, 25.0)
        planned = data_parallel_seconds(cluster, lay, parts, m, 1.0, 1.0)[2]
        moved = sent[("all_gather", "dp")] + sent[("reduce_scatter", "dp")]
        assert moved == pytest.approx(planned, rel=1e-12)


@functools.lru_cache(maxsize=None)
def _counted() -> list[list[dict]]:
    per_rank = run_on_ranks(_step_bytes, 4, [_counted_settings(*case) for case in COUNTED], timeout=600)
    return [[rank[i] for rank in per_rank] for i in range(len(COUNTED))]


def test_kept_gathered_units_hold_the_stage_whole_and_the_planner_prices_it():
    """--no-reshard-after-forward holds a stage's parameters gathered and their gradients staged
    whole through the schedule: the planner adds 4 + 4 bytes per parameter of the stage (fp32
    gathers and reductions; the first stage, with the embedding, is the fuller); ZeRO-2 under a
    pipeline holds the accumulated gradient whole (4 bytes) besides its staging buffers."""
    from strata.model.presets import get_preset
    from strata.plan.cost import estimate
    from strata.plan.inputs import build_cluster, workload
    from strata.rules.layout import Layout
    work, cluster = workload(get_preset("llama-1b"), 64, 2048, "bf16"), build_cluster("A100-80G", 1, 8, None, "ib-200")
    buffers = {(zero, reshard): estimate(work, cluster, Layout(dp=4, pp=2, zero=zero, reshard_after_forward=reshard,
                                                               micro_batch=1)).memory_breakdown["buffers"]
               for zero, reshard in ((3, True), (3, False), (2, True))}
    from strata.plan.stages import stage_loads
    stage = max(load.params for load in stage_loads(get_preset("llama-1b"), 2, 1, 2048))
    assert buffers[(3, False)] - buffers[(3, True)] == pytest.approx(8 * stage, rel=1e-12)
    assert buffers[(3, False)] > buffers[(2, True)] > 4 * stage


# --- checkpoints and bf16 gathers ------------------------------------------------------------------------
def _saved(directory: str) -> list[float]:
    return trainer.train(train_config(**{**BASE, **PIPELINE, "model": "tiny-gpt2", "zero": 3, "steps": 6,
                                         "save": directory, "save_every": 3}))["losses"]


def test_a_pp2_x_dp2_zero_3_checkpoint_resumes_on_one_process(tmp_path):
    """Saved at step 3 of 6 by pp2 x dp2 ZeRO-3 (tied embedding: the last stage's copy is not
    written), resumed there by one process: its last 3 losses are the uninterrupted single process's."""
    reference = trainer.train(train_config(**{**BASE, "model": "tiny-gpt2", "steps": 6}))["losses"]
    saved = run_on_ranks(_saved, 4, str(tmp_path / "ck"), timeout=600)[0]
    torch.testing.assert_close(saved, reference, rtol=1e-10, atol=0)
    resumed = trainer.train(train_config(**{**BASE, "model": "tiny-gpt2", "steps": 6,
                                            "resume": str(tmp_path / "ck" / "step_000003")}))["losses"]
    torch.testing.assert_close(resumed[-3:], reference[-3:], rtol=1e-10, atol=0)


def _bf16(settings: list[dict]) -> list[list[float]]:
    return [trainer.train(train_config(**each))["losses"] for each in settings]


def test_bf16_gathers_run_with_a_pipeline_under_zero_3():
    """--dtype bf16 --gather-dtype bf16, pp2 x dp2 ZeRO-3 (both modes), against the same layout with
    fp32 gathers: the layers then compute with bf16 weights instead of autocast's casts of the same
    fp32 masters (each weight rounded to 8 significant bits, as autocast rounds it for the matrix
    products, but now also for the norms' scales and the embedding lookup), and the gradients of
    bf16 weights come back in bf16 before they reach the fp32 staging. Measured 1.3e-4 relative
    after 3 steps of tiny; held to 2e-3, test_pipeline_bf16's bound for bf16 runs (the bf16 rounding
    of one weight, 2^-9, is its scale), and every rank reports the same."""
    common = {**BASE, **PIPELINE, "model": "tiny", "dtype": "bf16", "zero": 3}
    settings = [{**common, "gather_dtype": gather, "reshard_after_forward": reshard}
                for gather in ("bf16", "fp32") for reshard in (True, False)]
    ranks = run_on_ranks(_bf16, 4, settings, timeout=600)
    for rank in ranks:
        assert rank == ranks[0]
    for bf16, fp32 in zip(ranks[0][:2], ranks[0][2:]):
        assert bf16 != fp32  # the gathers did move bf16
        torch.testing.assert_close(bf16, fp32, rtol=2e-3, atol=0)


# --- what stays refused --------------------------------------------------------------------------------
@pytest.mark.parametrize("flags,needle", [
    (["--pp", "2", "--zero", "3", "--schedule", "zb"], "--schedule zb: not with zero 3"),
    (["--pp", "2", "--zero", "2", "--schedule", "2bw"], "--zero 2: not with --schedule 2bw"),
    (["--zero", "3", "--no-reshard-after-forward"], "--reshard-after-forward False: only with zero 3 and pp 2"),
    (["--pp", "2", "--zero", "3", "--offload-params", "cpu"], "--offload-params cpu: not with pp 2"),
])
def test_what_zero_under_a_pipeline_does_not_run_with_is_one_line(flags, needle):
    result = run_strata("train", "--model", "tiny", "--steps", "1", "--micro-batch", "1", "--nproc", "4",
                        "--global-batch", "8", *flags)
    assert_refused_in_one_line(result, needle)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr

