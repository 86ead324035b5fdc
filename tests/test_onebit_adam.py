"""1-bit Adam (--compress onebit, strata/parallel/onebit_adam.py): two ranks equal the
single-process run of its rule, written here apart from the runtime (each rank's gradient computed
on its rows, then Tang et al. 2021's update: AdamW for the warm-up, then v frozen and the momenta
averaged through sign compression with worker and server error feedback), in fp64 to 1e-10; the
bytes a step sends are the formula's (rules/compression.py); a resumed run goes on bit for bit; and
what the flag does not run with is one line."""

from __future__ import annotations

import math

import pytest
import torch
from test_compression import BASE

from strata.config import train_config
from strata.data.loader import BatchLoader
from strata.distributed import comm
from strata.rules.compression import onebit_padded, onebit_wire_bytes
from strata.train import trainer
from strata.train.optim import lr_at

from cli_runner import run_strata
from distributed import assert_compressed_runs_follow_the_rule, run_on_ranks

RANKS, AFTER, STEPS = 2, 2, 6
COMPRESSED = dict(compress="onebit", compress_after=AFTER)


# --- the rule, in one process ---------------------------------------------------------------------
def _sign_compressed(rows: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Each row (a chunk) as +-(its mean absolute value over its real elements), by each value's
    sign bit (+0 is +1, -0 is -1)."""
    scales = (rows.abs().sum(1) / real).unsqueeze(1)
    return torch.where(torch.signbit(rows), -scales, scales)


def _compressed_average(momenta: list[torch.Tensor], worker_errors: list[torch.Tensor],
                        server_errors: list[torch.Tensor], elements: int) -> torch.Tensor:
    """The ranks' flat momenta (padded) -> their 1-bit average; the errors updated in place."""
    ranks, padded = len(momenta), momenta[0].numel()
    chunk = padded // ranks
    real = torch.tensor([max(min(elements - j * chunk, chunk), 1) for j in range(ranks)], dtype=torch.float64)
    sent = []
    for r in range(ranks):
        corrected = (momenta[r] + worker_errors[r]).view(ranks, chunk)
        compressed = _sign_compressed(corrected, real)
        worker_errors[r].copy_((corrected - compressed).view(-1))
        worker_errors[r][elements:] = 0
        sent.append(compressed)
    average = []
    for j in range(ranks):  # rank j serves chunk j
        served = sum(sent[r][j] for r in range(ranks)) / ranks + server_errors[j]
        served[max(elements - j * chunk, 0):] = 0
        compressed = _sign_compressed(served.view(1, chunk), real[j:j + 1]).view(-1)
        server_errors[j].copy_(served - compressed)
        average.append(compressed)
    result = torch.cat(average)
    result[elements:] = 0
    return result


def _rank_gradients(run, loader: BatchLoader, step: int, ranks: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One rank's gradient: its rows' micro-batches, each loss x 1/ranks / micro-batches."""
    run.model.zero_grad(set_to_none=True)
    micro_batches = loader.micro_batches(step, 1)
    losses = []
    for inputs, targets in micro_batches:
        loss = run.model(inputs, targets)
        (loss / ranks / len(micro_batches)).backward()
        losses.append(loss.item())
    return {name: p.grad.clone() for name, p in run.model.named_parameters()}, losses


def single_process_rule(ranks: int, settings: dict) -> list[float]:
    """The losses of 1-bit Adam over `ranks` ranks' rows, every rank simulated in this process: the
    warm-up is torch's AdamW on the averaged gradient."""
    run = trainer.setup(train_config(**{**BASE, **settings, "nproc": 1}))
    data = run.train_data
    loaders = [BatchLoader(data.source, data.seq_len, data.global_batch, data.seed, dp_rank=r, dp_size=ranks)
               for r in range(ranks)]
    named = [(name, p) for name, p in run.model.named_parameters() if p.requires_grad]
    elements = sum(p.numel() for _, p in named)
    padded = onebit_padded(elements, ranks)
    worker_errors = [torch.zeros(padded, dtype=torch.float64) for _ in range(ranks)]
    server_errors = [torch.zeros(padded // ranks, dtype=torch.float64) for _ in range(ranks)]
    b1, b2 = run.cfg.beta1, run.cfg.beta2
    decay = {p: group["weight_decay"] for group in run.optimizer.param_groups for p in group["params"]}
    losses = []
    for step in range(STEPS):
        for group in run.optimizer.param_groups:
            group["lr"] = lr_at(step, run.cfg)
        per_rank = [_rank_gradients(run, loader, step, ranks) for loader in loaders]
        losses.append(sum(sum(rank_losses) for _, rank_losses in per_rank) / (ranks * len(per_rank[0][1])))
        grads = [g for g, _ in per_rank]  # each carries 1/ranks of the loss
        if step < AFTER:
            for name, param in named:
                param.grad = sum(g[name] for g in grads)
            trainer.update(run)
            continue
        states = [run.optimizer.state[p] for _, p in named]
        old = torch.cat([s["exp_avg"].reshape(-1) for s in states])
        momenta = []
        for g in grads:
            local = torch.cat([ranks * g[name].reshape(-1) for name, _ in named])
            momenta.append(torch.nn.functional.pad(b1 * old + (1 - b1) * local, (0, padded - elements)))
        average = _compressed_average(momenta, worker_errors, server_errors, elements)
        lr, t, at = lr_at(step, run.cfg), step + 1, 0
        with torch.no_grad():
            for (_, p), state in zip(named, states):
                state["exp_avg"].copy_(average[at:at + p.numel()].view_as(p))
                at += p.numel()
                denom = state["exp_avg_sq"].sqrt() / math.sqrt(1 - b2 ** AFTER) + 1e-8
                p.mul_(1 - lr * decay[p])
                p.sub_(lr / (1 - b1 ** t) * state["exp_avg"] / denom)
        run.model.zero_grad(set_to_none=True)
    return losses


def _on_ranks(settings: dict) -> list[float]:
    return trainer.train(train_config(**{**BASE, **settings}))["losses"]


@pytest.mark.parametrize("ranks,settings", [(2, {}), (3, {"global_batch": 6})])
def test_the_ranks_equal_the_single_process_rule_in_fp64(ranks, settings):
    """tiny's 106,816 elements split into whole bytes of signs on 2 ranks; on 3 the last chunk ends in
    8 elements of padding (106,816 = 24 x 4,450 + 16)."""
    reference = single_process_rule(ranks, settings)
    plain = run_on_ranks(_on_ranks, ranks, settings)[0]
    compressed = run_on_ranks(_on_ranks, ranks, {**settings, **COMPRESSED})
    assert_compressed_runs_follow_the_rule(compressed, reference, plain, AFTER)


def _step_bytes(settings: dict) -> dict:
    run = trainer.setup(train_config(**{**BASE, **settings}))
    sent = []
    for step in range(AFTER + 2):
        comm.counter.reset()
        trainer.train_step(run, step)
        sent.append(dict(comm.counter.bytes_sent))
    elements = sum(p.numel() for p in run.parallel.sharding.params)
    total = run.parallel.sharding.total
    run.parallel.close()
    comm.close_streams()
    return {"sent": sent, "elements": elements, "total": total}


def test_a_compressed_step_sends_the_formulas_bytes():
    """fp64, 2 ranks: the warm-up steps all-reduce the padded gradient buffer and the step's loss
    (a ring all-reduce sends 2(N-1)/N of its bytes); a compressed step all-reduces the loss only,
    and its all-to-all and all-gather each send (N-1)/N of rules/compression.onebit_wire_bytes:
    the momentum's signs, 8 a byte, and a scale per chunk: under 1/60 of the fp64 gradients."""
    ring = (RANKS - 1) / RANKS
    for rank in run_on_ranks(_step_bytes, RANKS, COMPRESSED):
        wire = onebit_wire_bytes(rank["elements"], RANKS, 8)
        for sent in rank["sent"][:AFTER]:
            assert sent == {("all_reduce", "dp"): 2 * ring * 8 * (rank["total"] + 1)}
        for sent in rank["sent"][AFTER:]:
            assert sent == {("all_reduce", "dp"): 2 * ring * 8, ("all_to_all", "dp"): ring * wire,
                            ("all_gather", "dp"): ring * wire}
        assert 2 * wire * 60 < 2 * 8 * rank["elements"]


@pytest.mark.parametrize("flags,needle", [
    (["--compress", "onebit", "--compress-after", "2"], "--compress onebit: compresses the data-parallel reduction"),
    (["--nproc", "2", "--compress", "onebit", "--compress-after", "2", "--zero", "1"],
     "replaces ZeRO-0's all-reduce; zero is 1"),
    (["--nproc", "2", "--compress", "onebit"], "--compress-after 0: 1-bit Adam freezes Adam's second moment"),
    (["--nproc", "2", "--compress", "onebit", "--compress-after", "2", "--compress-rank", "8"],
     "--compress-rank 8: only with --compress powersgd"),
    (["--nproc", "4", "--tp", "2", "--compress", "onebit", "--compress-after", "2"],
     "runs with data parallelism alone for now"),
    (["--nproc", "2", "--compress-after", "3"], "--compress-after 3: only with --compress powersgd or onebit"),
    (["--nproc", "2", "--compress", "onebit", "--compress-after", "2", "--offload", "cpu"],
     "--compress onebit: runs its own optimizer on the device; not with offload cpu"),
    (["--nproc", "2", "--compress", "onebit", "--compress-after", "2", "--schedule", "2bw", "--grad-clip", "0"],
     "--compress onebit: not with schedule 2bw"),
])
def test_what_onebit_does_not_run_with_is_one_line(flags, needle):
    result = run_strata("train", "--model", "tiny", "--steps", "1", "--micro-batch", "1", *flags)
    assert result.returncode == 2 and needle in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def _saved_and_resumed(directory: str) -> tuple[list[float], list[float]]:
    """STEPS steps saving after step AFTER + 1 (past the warm-up: both errors are nonzero), then a
    second run resumed from that checkpoint."""
    save_at = AFTER + 1
    whole = trainer.train(train_config(**{**BASE, **COMPRESSED, "save": directory, "save_every": save_at}))["losses"]
    resumed = trainer.train(train_config(**{**BASE, **COMPRESSED, "resume": f"{directory}/step_{save_at:06d}"}))
    return whole[save_at:], resumed["losses"]


def test_a_resumed_run_goes_on_bit_for_bit(tmp_path):
    """The momentum, v and the step go with AdamW's state; each rank's worker error and its chunk
    of the server error with its own shard file: without them the resumed steps would differ."""
    for whole, resumed in run_on_ranks(_saved_and_resumed, RANKS, str(tmp_path / "ck")):
        assert len(resumed) == STEPS - AFTER - 1
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(whole), rtol=1e-10, atol=0)


# --- the planner prices it ------------------------------------------------------------------------
def test_the_planner_counts_the_formulas_bytes_and_the_error_buffers():
    """`strata plan` for a 1B model on 8 nodes of 8 GPUs over 10 GbE: its data-parallel bytes are
    the two rounds of onebit_wire_bytes (fp32 scales) over the model's padded buckets, the error
    buffers are the worker's (the model) and the server's (1/dp) in fp32, and the step is faster
    than ZeRO-0's all-reduce there."""
    import dataclasses

    from strata.model.presets import get_preset
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
    assert b.comm_bytes["dp"] == pytest.approx(2 * 63 / 64 * onebit_wire_bytes(round(params), 64, 4), rel=1e-9)
    assert b.comm_bytes["dp"] < a.comm_bytes["dp"] / 30
    gradients = b.memory_breakdown["gradients"] - a.memory_breakdown["gradients"]
    assert gradients == pytest.approx(onebit_error_bytes(cfg.num_params(), 64), rel=1e-6)
    assert b.fits and b.step_time_s < a.step_time_s


def _error_bytes() -> dict:
    run = trainer.setup(train_config(**{**BASE, **COMPRESSED, "dtype": "fp32"}))
    for step in range(AFTER + 1):
        trainer.train_step(run, step)
    errors = sum(t.numel() * t.element_size() for t in run.parallel.sharding.errors().values())
    elements = sum(p.numel() for p in run.parallel.sharding.params)
    run.parallel.close()
    comm.close_streams()
    return {"errors": errors, "elements": elements}


def test_the_runtimes_error_buffers_are_the_planners_with_their_padding():
    from strata.plan.memory import onebit_error_bytes
    for rank in run_on_ranks(_error_bytes, RANKS):
        padded = onebit_padded(rank["elements"], RANKS)
        assert rank["errors"] == 4 * (padded + padded // RANKS)
        assert 0 <= rank["errors"] - onebit_error_bytes(rank["elements"], RANKS) < 4 * 8 * RANKS * 2
