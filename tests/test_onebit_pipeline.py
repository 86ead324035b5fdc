"""1-bit Adam and 0/1 Adam beside a pipeline (--compress onebit|zeroone --pp 2, ZeRO-0): each stage
runs the rule of tests/test_onebit_adam.py over its own parameters and its own dp group, its flat
buffer the stage's parameters end to end, as a dp-only run on a model of that stage would; a tied
embedding's copies (first and last stage) get the sum of their gradients before the momentum takes
them, and are a segment of their own on both stages (padded and cut in dp chunks on its own), so
that both stages compress them alike and they stay identical. pp2 x dp2 equals that rule, written
here per stage, in fp64 to 1e-10 for the synchronous schedules; a stage's compressed step sends its
own buffer's formula; a resumed run goes on bit for bit; the planner prices a stage's rounds."""

from __future__ import annotations

import math
from functools import lru_cache

import pytest
import torch
import torch.distributed as dist
from test_compression import BASE
from test_onebit_adam import (
    AFTER,
    COMPRESSED,
    RANKS,
    SCALER,
    STEPS,
    ZEROONE,
    _compressed_average,
    _deepspeed_variance_steps,
    _rank_gradients,
    _saved_and_resumed,
    _simulated_ranks,
    units,
)

from strata.config import sequence_length, train_config
from strata.distributed import comm
from strata.model.transformer import build_model
from strata.parallel.pipeline.stage import keep_stage
from strata.plan.buckets import onebit_scales
from strata.rules.compression import onebit_padded, onebit_pieces, onebit_wire_bytes
from strata.rules.pipeline_cut import make_layout
from strata.train import trainer
from strata.train.optim import lr_at

from distributed import assert_compressed_runs_follow_the_rule, run_on_ranks

PP = 2
PIPELINE = dict(pp=PP, nproc=PP * RANKS)
RULES = {"onebit": COMPRESSED, "zeroone": ZEROONE}


# --- the rule, per stage, in one process ------------------------------------------------------------
def stage_segments(model_cfg, seq_len: int, v: int) -> list[list[list[str]]]:
    """Each pipeline rank's segments (lists of parameter names, in the order its model holds them):
    its parameters end to end, or, holding a tied embedding's copy, that copy apart and the rest."""
    layout, stages = make_layout(model_cfg, PP, v, seq_len), []
    for rank in range(PP):
        model = build_model(model_cfg, seed=None)
        keep_stage(model, layout, rank)
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        tied = "embed.weight" if model_cfg.tie_embeddings and "embed.weight" in names else None
        stages.append([[tied], [n for n in names if n != tied]] if tied else [names])
    return stages


def pipeline_rule(model: str, compress: str, v: int) -> list[float]:
    return rule_and_norms(model, compress, v)[0]


@lru_cache(maxsize=None)
def rule_and_norms(model: str, compress: str, v: int) -> tuple[list[float], list[list[float]]]:
    """The losses of 1-bit Adam (or 0/1 Adam) over RANKS ranks' rows with each pipeline stage
    compressing its own segments: whole steps (1-bit Adam's warm-up, 0/1 Adam's steps updating v)
    are Adam on the average gradient; a compressed step averages, segment by segment, each rank's
    momentum m_r = b1 m + (1 - b1) g_r (1-bit) or gradient g_r (0/1, then m = b1 m + (1 - b1) of the
    average) through test_onebit_adam's _compressed_average. A tied embedding's segment is one computation: both stages
    hold it and start it alike, and its gradient is the sum of its two uses (the test below checks
    the copies stay identical). Also each step's gradient norm on each dp rank: the average
    gradient's on a whole step, the rank's own gradient's (RANKS x what its rows carry) on a
    compressed one, over the whole model (a tied embedding once)."""
    settings = {"model": model}
    run, loaders, named, _, _, (b1, b2), decay = _simulated_ranks(RANKS, settings)
    params = dict(named)
    segments = {tuple(s): None for stage in stage_segments(run.model_cfg, sequence_length(run.cfg, run.model_cfg), v)
                for s in stage}
    errors = {}
    for segment in segments:
        padded = onebit_padded(sum(params[n].numel() for n in segment), RANKS)
        errors[segment] = ([torch.zeros(padded, dtype=torch.float64) for _ in range(RANKS)],
                           [torch.zeros(padded // RANKS, dtype=torch.float64) for _ in range(RANKS)])
    whole_steps = _deepspeed_variance_steps(STEPS, SCALER) if compress == "zeroone" else set(range(1, AFTER + 1))
    m = {name: torch.zeros_like(p) for name, p in named}
    var = {name: torch.zeros_like(p) for name, p in named}
    updates, losses, norms = 0, [], []
    for step in range(STEPS):
        t = step + 1
        per_rank = [_rank_gradients(run, loader, step, RANKS) for loader in loaders]
        losses.append(sum(sum(rank_losses) for _, rank_losses in per_rank) / (RANKS * len(per_rank[0][1])))
        grads = [g for g, _ in per_rank]  # each carries 1/RANKS of the loss
        own = [[RANKS * g[name] for name, _ in named] for g in grads]
        whole = [[sum(g[name] for g in grads) for name, _ in named]] * RANKS
        norms.append([math.sqrt(sum(float(x.square().sum()) for x in tensors))
                      for tensors in (whole if t in whole_steps else own)])
        if t in whole_steps:
            for name, _ in named:
                average = sum(g[name] for g in grads)
                m[name] = b1 * m[name] + (1 - b1) * average
                var[name] = b2 * var[name] + (1 - b2) * average ** 2
            updates += 1
        else:
            for segment, (worker, server) in errors.items():
                sizes, padded = [params[n].numel() for n in segment], worker[0].numel()
                flats = []
                for g in grads:
                    local = torch.cat([RANKS * g[n].reshape(-1) for n in segment])
                    if compress == "onebit":
                        local = b1 * torch.cat([m[n].reshape(-1) for n in segment]) + (1 - b1) * local
                    flats.append(torch.nn.functional.pad(local, (0, padded - sum(sizes))))
                average, at = _compressed_average(flats, worker, server, units([(n, params[n]) for n in segment])), 0
                for n, size in zip(segment, sizes):
                    piece = average[at:at + size].view_as(params[n])
                    m[n] = piece if compress == "onebit" else b1 * m[n] + (1 - b1) * piece
                    at += size
        lr = lr_at(step, run.cfg)
        with torch.no_grad():
            for name, p in named:
                p.mul_(1 - lr * decay[p])
                p.sub_(lr / (1 - b1 ** t) * m[name] / (var[name].sqrt() / math.sqrt(1 - b2 ** updates) + 1e-8))
        run.model.zero_grad(set_to_none=True)
    return losses, norms


def _losses(settings: dict) -> list[float]:
    return trainer.train(train_config(**{**BASE, **settings}))["losses"]


@lru_cache(maxsize=None)
def _plain(model: str) -> list[float]:
    return run_on_ranks(_losses, RANKS, {"model": model})[0]


@pytest.mark.parametrize("compress,schedule,v,model,zero", [
    ("onebit", "interleaved", 2, "tiny-gpt2", 1), ("onebit", "zb", 1, "tiny", 0), ("zeroone", "interleaved", 2, "tiny", 1)])
def test_pp2_dp2_follows_the_rule_per_stage_in_fp64(compress, schedule, v, model, zero):
    """The stages compress in the optimizer step, after the schedule and the tied embedding's sum,
    whatever order backward ran in: interleaved (a rank's two chunks, not adjacent layers, in one flat
    buffer), zb (weight gradients after the last backward); tiny-gpt2 has a tied embedding. Both rules
    under 1f1b on tiny-gpt2: the tied copies' test below. (gpipe and 1f1b differ from these only in
    the order backward runs, which the optimizer step never sees; they ran here until the suite
    needed the time.) The interleaved cases run under ZeRO-1: each stage's shards updated from the
    same whole m (1-bit Adam) or average gradient (0/1 Adam), the tied copies' shards cut by each
    stage's own buckets."""
    settings = {**RULES[compress], **PIPELINE, "model": model, "schedule": schedule, "virtual_stages": v,
                "zero": zero}
    compressed = run_on_ranks(_losses, PP * RANKS, settings)
    assert_compressed_runs_follow_the_rule(compressed, pipeline_rule(model, compress, v), _plain(model), AFTER)


# --- a tied embedding's copies -----------------------------------------------------------------------
def _tied_copies(settings: dict) -> dict:
    """Every step's losses; and, on the stages holding a tied embedding's copy, the copy's gradient
    the optimizer step reads (each rank's own on a compressed step), what goes into the compressed
    average of it and what comes out, the copy after the step, and its errors at the end."""
    run = trainer.setup(train_config(**{**BASE, **settings}))
    strategy, tied = run.parallel.sharding, run.model.tied_weight()
    averager = strategy.averager
    seen, losses, norms = [], [], []
    if tied is not None:
        at = averager.offsets[tied]
        part = slice(at, at + tied.numel())
        average, optimizer_step = averager.average, run.optimizer.step

        def spy_average(flat):
            seen.append(("into the average", flat[part].clone()))
            average(flat)
            seen.append(("out of the average", flat[part].clone()))

        def spy_step(*args, **kwargs):
            seen.append(("gradient", tied.grad.clone()))
            return optimizer_step(*args, **kwargs)

        averager.average, run.optimizer.step = spy_average, spy_step
    for step in range(STEPS):
        loss, norm, _ = trainer.train_step(run, step)
        losses.append(loss)
        norms.append(norm)
        if tied is not None:
            seen.append(("copy", tied.detach().clone()))
    width = onebit_padded(tied.numel(), RANKS) // RANKS if tied is not None else 0
    errors = (averager.worker_error[:RANKS * width].clone(), averager.server_error[:width].clone())
    result = {"losses": losses, "norms": norms, "dp": strategy.dp_rank, "last": run.model.final_norm is not None,
              "seen": seen, "errors": errors}
    run.parallel.close()
    comm.close_streams()
    return result


@pytest.mark.parametrize("compress", ["onebit", "zeroone"])
def test_a_tied_embeddings_copies_stay_identical(compress):
    """tiny-gpt2, 1f1b: on every step, whole or compressed, the first and the last stage's rank of a
    dp index read the same gradient of their copies (on a compressed step each rank's own, unreduced:
    the sum of its two uses), put the same into the compressed average and get the same out, and
    hold the same copy after it (bitwise), with the same errors; every dp index the same copy. The
    gradient norm each rank reports is the rule's: the average's on a whole step, on a compressed one
    the rank's own gradient's over the whole model (its stage's, summed over the stages)."""
    settings = {**RULES[compress], **PIPELINE, "model": "tiny-gpt2"}
    ranks = run_on_ranks(_tied_copies, PP * RANKS, settings)
    assert_compressed_runs_follow_the_rule([r["losses"] for r in ranks], pipeline_rule("tiny-gpt2", compress, 1),
                                           _plain("tiny-gpt2"), AFTER)
    compressed = STEPS - (AFTER if compress == "onebit" else len(_deepspeed_variance_steps(STEPS, SCALER)))
    firsts = {r["dp"]: r for r in ranks if not r["last"]}
    lasts = {r["dp"]: r for r in ranks if r["last"]}
    assert sorted(firsts) == sorted(lasts) == list(range(RANKS))
    for dp in range(RANKS):
        first, last = firsts[dp], lasts[dp]
        kinds = [kind for kind, _ in first["seen"]]
        assert kinds == [kind for kind, _ in last["seen"]]
        assert kinds.count("into the average") == compressed and kinds.count("copy") == STEPS
        for (kind, a), (_, b) in zip(first["seen"], last["seen"]):
            assert torch.equal(a, b), kind
        for a, b in zip(first["errors"], last["errors"]):
            assert torch.equal(a, b) and a.abs().sum() > 0
    norms = rule_and_norms("tiny-gpt2", compress, 1)[1]
    for rank in ranks:
        torch.testing.assert_close(torch.tensor(rank["norms"]), torch.tensor([n[rank["dp"]] for n in norms]),
                                   rtol=1e-10, atol=0)
    assert any(a != b for a, b in norms)  # on compressed steps each rank's own
    ends = [r["seen"][-1][1] for r in ranks]
    assert all(torch.equal(end, ends[0]) for end in ends)
    local = [[t for kind, t in firsts[dp]["seen"] if kind == "into the average"][-1] for dp in range(RANKS)]
    assert not torch.equal(local[0], local[1])  # each dp rank's own


def _cut(sizes: list[int], elements: int, dp: int) -> list[int]:
    """The lengths of the pieces the first `elements` elements of units of `sizes` end to end are cut in."""
    lengths, left = [], elements
    for n in (n for chunk in onebit_pieces(sizes, dp) for n in chunk):
        if left <= 0:
            break
        lengths.append(n)
        left -= n
    return lengths


def test_why_a_tied_copy_is_a_segment_of_its_own():
    """GPT-2 124M on pp 2 x dp 64: with the stages' parameters end to end, the embedding (first on
    both stages) would be cut where each stage's chunk boundaries fall, which differ (the stages hold
    different parameters besides it): different pieces, different scales, copies drifting apart. As
    a segment of its own it is cut alike. (tiny-gpt2 at dp 2 puts it in one piece either way: the
    runs above show the segment's bytes and bits; this, why it is there.) Its units are its rows."""
    from strata.model.presets import get_preset
    from strata.plan.buckets import held_parameters
    from strata.plan.stages import stage_loads
    cfg = get_preset("gpt2-124m")
    first, last = (load for load in stage_loads(cfg, 2, 1, 1024))
    stages = [[size for size, _ in held_parameters(cfg, load.layers, load.first, load.last)] for load in (first, last)]
    embedding = cfg.vocab_size * cfg.d_model
    assert stages[0][0] == stages[1][0] == embedding and stages[0][1:] != stages[1][1:]
    rows = [cfg.d_model] * cfg.vocab_size
    assert _cut(rows + stages[0][1:], embedding, 64) != _cut(rows + stages[1][1:], embedding, 64)


# --- the bytes ----------------------------------------------------------------------------------------
def _step_bytes(settings: dict) -> dict:
    run = trainer.setup(train_config(**{**BASE, **settings}))
    strategy, sent = run.parallel.sharding, []
    for step in range(AFTER + 1):
        comm.counter.reset()
        trainer.train_step(run, step)
        sent.append({key: n for key, n in comm.counter.bytes_sent.items() if key[1] == "dp"})
    names = {id(p): name for name, p in run.model.named_parameters()}
    shapes = [(names[id(p)], p.numel(), p.shape[-1] if names[id(p)] in ("embed.weight", "pos_embed.weight") else 0)
              for p in strategy.params]
    chunks, last = run.stage_layout.chunks_of(dist.get_rank(run.pp_group)), run.stage_layout.num_chunks - 1
    planned = onebit_scales(run.model_cfg, len(run.model.layers()), RANKS, 0 in chunks, last in chunks)
    run.parallel.close()
    comm.close_streams()
    return {"sent": sent, "params": shapes, "planned": planned}


@pytest.mark.parametrize("model", ["tiny", "tiny-gpt2"])
def test_a_stages_compressed_step_sends_its_own_buffers_formula(model):
    """fp64, dp 2: a stage's compressed step all-reduces the loss over dp, and its all-to-all and
    all-gather each send (N-1)/N of onebit_wire_bytes of its own flat buffer (tiny: the stage's
    elements; tiny-gpt2: the tied copy's segment padded on its own, then the rest) with its own
    scales per row (the most pieces a chunk of it holds, counted here from the segments)."""
    ring = (RANKS - 1) / RANKS
    stages = run_on_ranks(_step_bytes, PP * RANKS, {**COMPRESSED, **PIPELINE, "model": model})
    assert len({tuple(rank["params"]) for rank in stages}) == PP
    for rank in stages:
        sizes, rows = {n: size for n, size, _ in rank["params"]}, {n: row for n, _, row in rank["params"]}
        segments = [["embed.weight"], [n for n in sizes if n != "embed.weight"]] if model == "tiny-gpt2" \
            else [list(sizes)]
        pieces = [onebit_pieces([u for n in segment for u in ([rows[n]] * (sizes[n] // rows[n]) if rows[n]
                                                              else [sizes[n]])], RANKS) for segment in segments]
        scales = max(sum(len(p[j]) for p in pieces) for j in range(RANKS))
        assert scales == rank["planned"]  # the planner's count (plan/buckets.onebit_scales) from the shapes
        padded = sum(onebit_padded(sum(sizes[n] for n in segment), RANKS) for segment in segments)
        if model == "tiny":
            assert padded == onebit_padded(sum(sizes.values()), RANKS)
        wire = onebit_wire_bytes(padded, RANKS, 8, scales)
        assert set(rank["sent"][0]) == {("all_reduce", "dp")}
        assert rank["sent"][AFTER] == {("all_reduce", "dp"): 2 * ring * 8, ("all_to_all", "dp"): ring * wire,
                                       ("all_gather", "dp"): ring * wire}


# --- resuming -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("compress", ["onebit", "zeroone"])
def test_a_resumed_run_goes_on_bit_for_bit_under_a_pipeline(tmp_path, compress):
    """Each rank's errors go in its own shard file (the pipeline's ranks each write one): tiny-gpt2,
    whose stages both hold the tied copy's segment."""
    settings = {**RULES[compress], **PIPELINE, "model": "tiny-gpt2"}
    for whole, resumed in run_on_ranks(_saved_and_resumed, PP * RANKS, str(tmp_path / "ck"), settings):
        assert len(resumed) == STEPS - AFTER - 1
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(whole), rtol=1e-10, atol=0)


# --- the planner prices it ----------------------------------------------------------------------------
def test_the_planner_prices_a_stages_rounds_and_searches_them():
    """1B on 8 nodes of 8 A100s over 10 GbE, dp 16 x pp 4: the (slowest) stage's data-parallel bytes
    are the two rounds of onebit_wire_bytes (fp32 scales) over the stage's padded buckets with the
    stage's own scales per row, each a ring's (dp-1)/dp share; `strata plan` searches 1-bit Adam beside a pipeline."""
    import dataclasses

    from strata.model.presets import get_preset
    from strata.plan.buckets import onebit_scales
    from strata.plan.cost import estimate
    from strata.plan.inputs import build_cluster, workload
    from strata.plan.search import search
    from strata.plan.stages import stage_loads
    from strata.rules.layout import Layout
    cfg = get_preset("llama-1b")  # tied: the first and the last stage hold its copies apart
    work, cluster = workload(cfg, 512, 2048, "bf16"), build_cluster("A100-80G", 8, 8, None, "10gbe")
    plain = Layout(dp=16, pp=4, checkpointing="full", micro_batch=1)
    compressed = dataclasses.replace(plain, compress="onebit", compress_after=100)
    a, b = estimate(work, cluster, plain), estimate(work, cluster, compressed)
    # the slowest stage's (the step waits for it): its ZeRO-0 all-reduce of its fp32 padded buckets
    params = a.comm_bytes["dp"] / (2 * 15 / 16 * 4)
    scales = [onebit_scales(cfg, load.layers, 16, load.first, load.last) for load in stage_loads(cfg, 4, 1, 2048)]
    priced = [s for s in scales if b.comm_bytes["dp"] == pytest.approx(
        2 * 15 / 16 * onebit_wire_bytes(round(params), 16, 4, s), rel=1e-9)]
    assert len(priced) == 1 and priced[0] != onebit_scales(cfg, cfg.n_layers, 16)  # the stage's, not the model's
    assert b.comm_bytes["dp"] < a.comm_bytes["dp"] / 30
    ranked, _ = search(work, cluster, offload=False)
    piped = {e.layout.compress for e in ranked if e.layout.pp > 1}
    assert {"powersgd", "onebit"} <= piped
