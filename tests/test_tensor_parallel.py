"""Tensor parallelism (and sequence parallelism) against the single-process run, and its traffic
against the Megatron count."""

import functools

import pytest
import torch

from strata.config import train_config
from strata.model.presets import get_preset
from strata.plan.cost import Cluster, Workload, estimate
from strata.plan.hardware import get_device
from strata.rules.layout import Layout
from strata.rules.tensor_modes import grid_of
from strata.rules.tensor_traffic import ElementBytes, step_bytes
from strata.train.trainer import train

from cli_runner import run_strata
from distributed import SharedLaunches, assert_states_close, run_on_ranks
from memory_probe import saved_bytes_of_first_block

# vocab 250 is not divisible by 4, so tp 4 pads it to 252 (the padding must not change the loss); tiny has
# 4 query heads and 2 KV heads, so tp 4 replicates the KV heads.
BASE = dict(seq_len=32, steps=10, progress=False, peak_flops=1e10, eval_batches=1, lr=3e-3, seed=7,
            vocab_size=250, global_batch=4, micro_batch=2, grad_clip=0.5)


def _run(settings):
    s = train(train_config(**{**BASE, **settings}), keep_state=True)
    return {"losses": s["losses"], "state": s["state"], "record": s["records"][-1]}


@functools.lru_cache(maxsize=None)
def single_process(model, dtype):
    return _run(dict(model=model, dtype=dtype))


def _key(**settings):
    return tuple(sorted(settings.items()))


LAYOUTS = [
    ("tiny", 2, dict(tp=2)),
    ("tiny", 2, dict(tp=2, sequence_parallel=True)),
    ("tiny", 4, dict(tp=4)),  # replicated KV heads, padded vocabulary
    ("tiny", 4, dict(tp=4, sequence_parallel=True)),
    ("tiny-gpt2", 2, dict(tp=2, sequence_parallel=True)),  # biases, tied embeddings, learned positions
    ("tiny", 4, dict(dp=2, tp=2, zero=0)),
    ("tiny", 4, dict(dp=2, tp=2, zero=1)),
    ("tiny", 4, dict(dp=2, tp=2, zero=2, sequence_parallel=True)),
    ("tiny", 4, dict(dp=2, tp=2, zero=3)),
]


TRAFFIC = [dict(tp=2, sequence_parallel=sequence_parallel, model="tiny", dtype="fp32", checkpointing=checkpointing)
           for sequence_parallel in (False, True) for checkpointing in ("none", "full")]
# One process group per layout runs its fp64 and its fp32 run, and one runs the four traffic runs:
# the same runs as a launch each, fewer process groups to start.
LAUNCHES = [(world, tuple(_key(**layout, model=model, dtype=dtype) for dtype in ("fp64", "fp32")))
            for model, world, layout in LAYOUTS] + [(2, tuple(_key(**layout) for layout in TRAFFIC))]
parallel_run = SharedLaunches(_run, LAUNCHES, timeout=600)


@pytest.mark.parametrize("dtype,rtol", [("fp64", 1e-10), ("fp32", 1e-5)])
@pytest.mark.parametrize("model,world,layout", LAYOUTS, ids=lambda v: str(v))
def test_tensor_parallel_reproduces_the_single_process_run(model, world, layout, dtype, rtol):
    reference = single_process(model, dtype)
    ranks = parallel_run(world, _key(**layout, model=model, dtype=dtype))
    for rank in ranks:
        torch.testing.assert_close(rank["losses"], reference["losses"], rtol=rtol, atol=0)
    assert_states_close(ranks[0]["state"], reference["state"], dtype, BASE["lr"])  # the logical parameters


def tp_bytes_per_micro_batch(cfg, b, s, t, sequence_parallel, recompute, element=4):
    """Bytes each rank sends in the tp group for one micro-batch (forward and backward), from the
    Megatron analysis: per block 2 all-reduces of b·s·h forward and 2 backward, each 2(t-1)/t of
    its size; with sequence parallelism, all-gathers and reduce-scatters of the same volume, plus
    the all-gather in backward that re-creates each column group's input from the shard kept.
    Full recomputation runs each block's forward again only as far as the last tensor backward
    needs (torch.utils.checkpoint stops there): all but the MLP's closing reduction, so one more
    all-reduce (or, with sequence parallelism, reduce-scatter) per block."""
    bsh, ring = b * s * cfg.d_model * element, (t - 1) / t
    per_block = 4 * 2 * ring * bsh  # identical with and without sequence parallelism
    embedding = 2 * ring * bsh + (ring * bsh if sequence_parallel else 0)  # all-reduce (+ split's gather)
    head_input = 2 * ring * bsh  # copy's all-reduce backward, or gather forward + scatter backward
    if sequence_parallel:  # Korthikanti's re-gather of each column group's input in backward
        per_block += 2 * ring * bsh
        head_input += ring * bsh
    if recompute:
        per_block += (1 if sequence_parallel else 2) * ring * bsh
    cross_entropy = 2 * ring * 3 * b * s * element  # max, then (target logit, sum of exp)
    return cfg.n_layers * per_block, embedding + head_input + cross_entropy


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_tp_traffic_matches_the_megatron_count_and_the_planners(sequence_parallel, checkpointing):
    """The counted bytes equal Megatron's count, derived here; rules/tensor_traffic.py's and the
    planner's equal it too."""
    layout = {"tp": 2, "sequence_parallel": sequence_parallel, "model": "tiny", "dtype": "fp32",
              "checkpointing": checkpointing}
    ranks = parallel_run(2, _key(**layout))
    cfg, t, micro_batches = get_preset("tiny").with_overrides(vocab_size=BASE["vocab_size"]), 2, 2
    recompute = checkpointing == "full"
    blocks, rest = tp_bytes_per_micro_batch(cfg, BASE["micro_batch"], BASE["seq_len"], t, sequence_parallel,
                                            recompute)
    norm_grads = (2 * cfg.n_layers + 1) * cfg.d_model * 4 * 2 * (t - 1) / t if sequence_parallel else 0
    grad_norm = 2 * (t - 1) / t * 8  # one fp64 sum of squares
    expected = micro_batches * (blocks + rest) + norm_grads
    for rank in ranks:
        by_op = rank["record"]["comm_bytes_by_op"]
        measured = sum(v for k, v in by_op.items() if k.endswith("/tp"))
        assert measured == pytest.approx(expected + grad_norm, rel=1e-12), by_op
        ops = {k.split("/")[0] for k in by_op if k.endswith("/tp")}
        assert ops == ({"all_reduce", "all_gather", "reduce_scatter"} if sequence_parallel else {"all_reduce"})
    tokens = BASE["micro_batch"] * BASE["seq_len"]
    rule = step_bytes(cfg, grid_of("1d", t), tokens, ElementBytes.uniform(4), micro_batches,
                      cfg.n_layers if recompute else 0, sequence_parallel)
    assert rule.total == pytest.approx(expected, rel=1e-12)
    work = Workload(cfg, BASE["global_batch"], BASE["seq_len"], "fp32")
    lay = Layout(tp=2, micro_batch=BASE["micro_batch"], sequence_parallel=sequence_parallel,
                 checkpointing=checkpointing)
    planned = estimate(work, Cluster(get_device("A100-80G"), 1, 2, 25e9, 25e9), lay)
    assert planned.comm_bytes["tp"] == pytest.approx(expected, rel=1e-12)


def test_generation_with_tp_equals_single_process(tmp_path):
    run = lambda *a: run_strata(*a, timeout=300)  # noqa: E731 - as a user runs it (tests/cli_runner.py)
    trained = run("train", "--model", "tiny", "--steps", 3, "--global-batch", 2, "--micro-batch", 2, "--seq-len", 32,
                  "--vocab-size", 250, "--save", tmp_path / "ck", "--no-progress", "--peak-flops", 1e10)
    assert trained.returncode == 0, trained.stderr
    outputs = {}
    for tp in (1, 2, 4):
        result = run("generate", "--checkpoint", tmp_path / "ck", "--prompt-ids", "1,2,3", "--max-new-tokens", 16,
                     "--temperature", 0, "--tp", tp)
        assert result.returncode == 0, result.stderr
        outputs[tp] = result.stdout.split()
    assert len(outputs[1]) == 3 + 16
    assert outputs[2] == outputs[1] and outputs[4] == outputs[1]


def _saved_bytes_of_first_block(tp, sequence_parallel):
    return saved_bytes_of_first_block(tp=tp, sequence_parallel=sequence_parallel)


def test_activation_memory_per_layer_falls_with_tp_as_korthikanti_predicts():
    """Korthikanti et al. 2022 (Table 2) split a block's saved activations into a part every TP
    rank keeps whole (the norm regions) and a part split t ways, and with sequence parallelism
    split the first part too. For strata's LLaMA block (RMSNorm, SwiGLU, fused attention that
    keeps no s x s scores), per token in fp32 elements:
      kept whole: 2 norms x (input h, normalised h, output h, 1/rms) = 6h + 2
      split:      q h, k and v h·kv/a each, attention output h, log-sum-exp a, SwiGLU 4 d_ff
    """
    cfg, b, s = get_preset("tiny"), 2, 64
    h, a, ff = cfg.d_model, cfg.n_heads, cfg.d_ff
    replicated = 6 * h + 2
    split = h + 2 * h * cfg.kv_heads / a + h + a + 4 * ff
    tokens_bytes = b * s * 4
    t1 = _saved_bytes_of_first_block(1, False)
    assert t1 == pytest.approx(tokens_bytes * (replicated + split), rel=0.10)
    tp2 = run_on_ranks(_saved_bytes_of_first_block, 2, 2, False)
    sp2 = run_on_ranks(_saved_bytes_of_first_block, 2, 2, True)
    predicted_tp = (replicated + split / 2) / (replicated + split)  # sbh(10 + 24/t + ...) in kind
    predicted_sp = 1 / 2  # sbh(34/t + 5as/(ht)): everything divided by t
    for measured in tp2:
        assert measured / t1 == pytest.approx(predicted_tp, rel=0.10), (measured, t1)
    for measured in sp2:
        assert measured / t1 == pytest.approx(predicted_sp, rel=0.10), (measured, t1)
