"""Compressed gradients (--compress powersgd, strata/parallel/powersgd.py): two ranks equal the
single-process run of PowerSGD's rule, written here apart from the runtime (each rank's gradient
computed on its rows, then the rule of Vogels et al. 2019 with error feedback and a warm start, as
PyTorch's powerSGD_hook applies it), in fp64 to 1e-10; the bytes a step all-reduces are the
formula's (rules/compression.py); and what the flag does not run with is one line."""

from __future__ import annotations

import math

import pytest
import torch

from strata.config import train_config
from strata.data.loader import BatchLoader
from strata.distributed import comm
from strata.rules.compression import powersgd_elements, q_seed
from strata.train import trainer
from strata.train.optim import lr_at

from cli_runner import assert_refused_in_one_line, run_strata
from distributed import assert_compressed_runs_follow_the_rule, run_on_ranks

RANKS, RANK, AFTER, STEPS = 2, 2, 2, 6
BASE = dict(model="tiny", seq_len=16, micro_batch=1, global_batch=4, steps=STEPS, progress=False, eval_batches=1,
            device="cpu", dtype="fp64", grad_clip=0.0, lr=3e-3, seed=5, bucket_mb=0.02)  # a dozen buckets
COMPRESSED = dict(compress="powersgd", compress_rank=RANK, compress_after=AFTER)


# --- the rule, in one process ---------------------------------------------------------------------
def _orthonormal(p: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(p, mode="reduced").Q


def _compressed(shape, rank: int) -> bool:
    n, m = shape[0], math.prod(shape[1:])
    return len(shape) >= 2 and 2 * rank * (n + m) < n * m


def _rank_gradients(run, loader: BatchLoader, step: int) -> dict[str, torch.Tensor]:
    """One rank's gradient: its rows' micro-batches, each loss x 1/ranks / micro-batches."""
    model = run.model
    model.zero_grad(set_to_none=True)
    micro_batches = loader.micro_batches(step, 1)
    losses = []
    for inputs, targets in micro_batches:
        loss = model(inputs, targets)
        (loss / RANKS / len(micro_batches)).backward()
        losses.append(loss.item())
    return {name: p.grad.clone() for name, p in model.named_parameters()}, losses


def single_process_rule(**settings) -> list[float]:
    """The losses of PowerSGD's rule over RANKS ranks' rows, every rank simulated in this process
    (each matrix's first Q drawn from --seed and its name: rules/compression.q_seed)."""
    run = trainer.setup(train_config(**{**BASE, **settings, "nproc": 1}))
    data = run.train_data
    loaders = [BatchLoader(data.source, data.seq_len, data.global_batch, data.seed, dp_rank=r, dp_size=RANKS)
               for r in range(RANKS)]
    named = [(name, p) for name, p in run.model.named_parameters() if p.requires_grad]
    qs, errors, losses = {}, {}, []
    for step in range(STEPS):
        for group in run.optimizer.param_groups:
            group["lr"] = lr_at(step, run.cfg)
        per_rank = [_rank_gradients(run, loader, step) for loader in loaders]
        losses.append(sum(sum(rank_losses) for _, rank_losses in per_rank) / (RANKS * len(per_rank[0][1])))
        grads = [g for g, _ in per_rank]
        for name, param in named:
            if step < AFTER or not _compressed(tuple(param.shape), RANK):
                param.grad = sum(g[name] for g in grads)
                continue
            shape = (param.shape[0], math.prod(param.shape[1:]))
            ms = [g[name].reshape(shape) + errors.get((name, r), 0) for r, g in enumerate(grads)]
            if name not in qs:
                generator = torch.Generator().manual_seed(q_seed(BASE["seed"], name))
                qs[name] = _orthonormal(torch.randn(shape[1], RANK, generator=generator, dtype=torch.float64))
            p = _orthonormal(sum(m @ qs[name] for m in ms))
            qs[name] = sum(m.t() @ p for m in ms)
            approximation = p @ qs[name].t()
            for r, m in enumerate(ms):
                errors[(name, r)] = m - approximation / RANKS
            param.grad = approximation.reshape(param.shape)
        trainer.update(run)
    return losses


def _two_ranks(settings: dict) -> list[float]:
    return trainer.train(train_config(**{**BASE, **settings}))["losses"]


def test_two_ranks_equal_the_single_process_rule_in_fp64():
    reference = single_process_rule()
    plain = run_on_ranks(_two_ranks, RANKS, {})[0]
    compressed = run_on_ranks(_two_ranks, RANKS, COMPRESSED)
    assert_compressed_runs_follow_the_rule(compressed, reference, plain, AFTER)


def _step_bytes(settings: dict) -> dict:
    run = trainer.setup(train_config(**{**BASE, **settings}))
    sent = []
    for step in range(AFTER + 1):
        comm.counter.reset()
        trainer.train_step(run, step)
        sent.append(comm.counter.bytes_sent[("all_reduce", "dp")])
    shapes = [tuple(p.shape) for p in run.parallel.sharding.params]
    total = run.parallel.sharding.total
    run.parallel.close()
    comm.close_streams()
    return {"sent": sent, "shapes": shapes, "total": total}


def test_a_compressed_step_all_reduces_the_formulas_elements():
    """fp64, 2 ranks (a ring all-reduce sends 2(N-1)/N of its bytes): the uncompressed steps send
    the padded buffer and the step's loss; the compressed one the P round (every tensor left whole)
    and the Q round of rules/compression.powersgd_elements, and the loss."""
    ring = 2 * (RANKS - 1) / RANKS * 8
    for rank in run_on_ranks(_step_bytes, RANKS, COMPRESSED):
        first, second = powersgd_elements(rank["shapes"], RANK)
        assert rank["sent"][:AFTER] == [ring * (rank["total"] + 1)] * AFTER
        assert rank["sent"][AFTER] == ring * (first + second + 1)
        assert (first + second) * 4 < rank["total"]  # tiny's matrices at rank 2: about a fifth of the bytes


@pytest.mark.parametrize("flags,needle", [
    (["--compress", "powersgd"], "--compress powersgd: compresses the data-parallel reduction, and dp is 1"),
    (["--nproc", "2", "--compress", "powersgd", "--zero", "1"], "replaces ZeRO-0's all-reduce; zero is 1"),
    (["--nproc", "2", "--compress", "topk"], "--compress topk: valid: none, powersgd, onebit, zeroone"),
    (["--nproc", "2", "--compress-rank", "8"], "--compress-rank 8: only with --compress powersgd"),
    (["--nproc", "2", "--compress", "powersgd", "--compress-rank", "0"], "--compress-rank 0: must be >= 1"),
    (["--nproc", "4", "--tp", "2", "--compress", "powersgd"], "runs with data parallelism alone for now"),
])
def test_what_compression_does_not_run_with_is_one_line(flags, needle):
    result = run_strata("train", "--model", "tiny", "--steps", "1", "--micro-batch", "1", *flags)
    assert_refused_in_one_line(result, needle)


# --- the planner prices it ------------------------------------------------------------------------
def test_the_planners_shares_are_the_runtimes_and_its_bytes_fall_by_them():
    """powersgd_fractions over the model's shapes as the planner lists them equal the runtime's
    parameters' (tiny); `strata plan`'s data-parallel bytes fall by the two rounds' share, and for a
    1B model on 8 nodes of 8 GPUs over 10 GbE the compressed step is the faster."""
    import dataclasses

    from strata.model.presets import get_preset
    from strata.model.transformer import build_model
    from strata.plan.buckets import powersgd_fractions
    from strata.plan.cost import estimate
    from strata.plan.inputs import build_cluster, workload
    from strata.rules.layout import Layout
    model = build_model(get_preset("tiny"), seed=None)
    shapes = [tuple(p.shape) for p in model.parameters()]
    first, second = powersgd_elements(shapes, RANK)
    total = sum(math.prod(s) for s in shapes)
    p_share, q_share, _ = powersgd_fractions(get_preset("tiny"), RANK)
    assert (p_share, q_share) == pytest.approx((first / total, second / total), rel=1e-12)
    cfg = get_preset("llama-1b")
    work, cluster = workload(cfg, 512, 2048, "bf16"), build_cluster("A100-80G", 8, 8, None, "10gbe")
    plain = Layout(dp=64, checkpointing="full", micro_batch=1)
    compressed = dataclasses.replace(plain, compress="powersgd", compress_rank=4)
    a, b = estimate(work, cluster, plain), estimate(work, cluster, compressed)
    p_share, q_share, _ = powersgd_fractions(cfg, 4)
    assert b.comm_bytes["dp"] == pytest.approx(a.comm_bytes["dp"] * (p_share + q_share), rel=1e-3)
    assert b.fits and b.step_time_s < a.step_time_s


def test_the_search_proposes_compression_where_it_pays_and_auto_leaves_it_to_the_user():
    """1B on 64 A100s over 10 GbE: data parallelism's compressed twins are searched, PowerSGD wins and
    --explain says what the best uncompressed layout loses; --parallel auto's search (compress=False)
    offers none, since it keeps the user's --compress."""
    from strata.model.presets import get_preset
    from strata.plan.inputs import build_cluster, workload
    from strata.plan.search import explain, search
    work, cluster = workload(get_preset("llama-1b"), 512, 2048, "bf16"), build_cluster("A100-80G", 8, 8, None, "10gbe")
    ranked, rejected = search(work, cluster, offload=False)
    assert ranked[0].layout.compress == "powersgd" and ranked[0].layout.tp == ranked[0].layout.pp == 1
    assert {e.layout.compress for e in ranked} == {"none", "powersgd", "onebit"}
    lines = explain(ranked[0], ranked, rejected, cluster)
    assert any(line.startswith("without compressed gradients: best is") and "slower" in line for line in lines)
    auto, _ = search(work, cluster, offload=False, compress=False)
    assert {e.layout.compress for e in auto} == {"none"}


def _wire_dtypes() -> set:
    """The dtypes of what a bf16 run's PowerSGD all-reduces (backward's hooks run inside autocast)."""
    seen, all_reduce = set(), comm.all_reduce

    def recorded(tensor, group, name, *args, **kwargs):
        if name == "dp" and tensor.numel() > 1:
            seen.add(str(tensor.dtype))
        return all_reduce(tensor, group, name, *args, **kwargs)
    comm.all_reduce = recorded
    try:
        trainer.train(train_config(**{**BASE, **COMPRESSED, "dtype": "bf16", "steps": AFTER + 2}))
    finally:
        comm.all_reduce = all_reduce
    return seen


def test_under_bf16_the_factors_travel_in_the_fp32_gradients_dtype():
    """A product inside backward's autocast came out bf16 in one bucket and fp32 in another, as each
    rank's timing retired them: 'small' died after 63 steps with wires of different sizes."""
    for seen in run_on_ranks(_wire_dtypes, RANKS):
        assert seen == {"torch.float32"}, seen
