"""Context parallelism (--cp, ring and Ulysses) against the single-process run: losses and weights
in fp64, with a causal mask, a sliding window and ALiBi; what the ranks send against
strata/rules/context.py; what a layer keeps for backward against 1/cp of one rank's; checkpoints
across layouts; generation from a model trained under --cp."""

import functools

import pytest
import torch
from family_runs import NEW_TOKENS, PROMPT_IDS, fp64_losses, greedy_tokens
from hf_cases import hf_model

from strata.cli import main as strata_main
from strata.config import train_config
from strata.memory.activations import count_saved_activations
from strata.model.presets import get_preset
from strata.rules.context import attention_traffic, extra_activation_elements, recomputed_traffic
from strata.train import trainer
from strata.train.trainer import train

from cli_runner import run_strata
from distributed import SharedLaunches, run_on_ranks

# tiny: 4 query heads over 2 KV heads (cp 4 under Ulysses repeats them), rotary positions
BASE = dict(model="tiny", seq_len=32, steps=6, progress=False, peak_flops=1e10, eval_batches=1, lr=3e-3, seed=7,
            vocab_size=251, global_batch=4, micro_batch=2, grad_clip=0.5, dtype="fp64")


def _run(settings):
    s = train(train_config(**{**BASE, **settings}), keep_state=True)
    return {"losses": s["losses"], "val": s["val_losses"], "state": s["state"], "record": s["records"][-1]}


def _key(**settings):
    return tuple(sorted(settings.items()))


LAYOUTS = [
    (2, dict(cp=2)),
    (2, dict(cp=2, cp_mode="ulysses")),
    (2, dict(cp=2, zero=2, checkpointing="full")),
    (2, dict(cp=2, cp_mode="ulysses", checkpointing="selective")),
    (2, dict(cp=2, compile=True)),  # the blocks compiled around the eager ring
    (4, dict(cp=4)),
    (4, dict(cp=4, cp_mode="ulysses")),  # 2 KV heads over 4 ranks: repeated to one per query head
    (4, dict(dp=2, cp=2, zero=1)),
    (4, dict(cp=2, tp=2, sequence_parallel=True)),
    (4, dict(cp=2, tp=2, cp_mode="ulysses")),
    (4, dict(cp=2, pp=2)),
    (4, dict(dp=2, cp=2, zero=3)),
    (8, dict(cp=2, tp=2, pp=2, sequence_parallel=True)),  # later stages get a tp-th of the rank's tokens
]
# bf16 autocast: what attention exchanges is what it computes with (q and k leave rotary in fp32)
BF16 = [(2, dict(cp=2, dtype="bf16")), (2, dict(cp=2, cp_mode="ulysses", dtype="bf16"))]
ASYNCHRONOUS = dict(schedule="2bw", grad_clip=0.0)  # PipeDream-2BW: its own single-process rule (--pp 1)
LAUNCHES = [(world, tuple(_key(**layout) for w, layout in LAYOUTS + BF16 if w == world)
             + ((_key(cp=2, pp=2, **ASYNCHRONOUS),) if world == 4 else ())) for world in (2, 4, 8)]
parallel_run = SharedLaunches(_run, LAUNCHES, timeout=900)


@functools.lru_cache(maxsize=None)
def single_process():
    return _run({})


@pytest.mark.parametrize("world,layout", LAYOUTS, ids=lambda v: str(v))
def test_context_parallel_reproduces_the_single_process_run(world, layout):
    """fp64, 6 steps: training and validation losses within 1e-10, the final weights within 1e-8."""
    reference = single_process()
    for rank in parallel_run(world, _key(**layout)):
        torch.testing.assert_close(rank["losses"], reference["losses"], rtol=1e-10, atol=0)
        torch.testing.assert_close(rank["val"], reference["val"], rtol=1e-10, atol=0)
        for name, value in reference["state"].items():
            torch.testing.assert_close(rank["state"][name], value, rtol=1e-8, atol=1e-10, msg=name)


def test_an_asynchronous_pipeline_over_context_parallel_ranks_follows_its_rule():
    """PipeDream-2BW on pp 2 x cp 2 equals one process running 2BW's version rule (fp64, 1e-10)."""
    reference = _run(ASYNCHRONOUS)
    for rank in parallel_run(4, _key(cp=2, pp=2, **ASYNCHRONOUS)):
        torch.testing.assert_close(rank["losses"], reference["losses"], rtol=1e-10, atol=0)
    assert reference["losses"] != single_process()["losses"]  # a rule of its own


def test_under_bf16_attention_exchanges_bf16_and_follows_one_process():
    """Under bf16 autocast the ring sends K and V in bf16 (their gradients in fp32, as they
    accumulate) and Ulysses exchanges q, k, v and the output in bf16: the rule's bytes with
    2-byte activations; the losses within bf16's reach of one process's."""
    model = get_preset("tiny").with_overrides(vocab_size=BASE["vocab_size"])
    reference = _run(dict(dtype="bf16"))
    tokens, micro_batches = BASE["micro_batch"] * BASE["seq_len"], BASE["global_batch"] // BASE["micro_batch"]
    for world, layout in BF16:
        mode = layout.get("cp_mode", "ring")
        forward, backward = attention_traffic(model, 2, mode, 1, tokens, 2, 4)
        for rank in parallel_run(world, _key(**layout)):
            torch.testing.assert_close(rank["losses"], reference["losses"], rtol=2e-3, atol=0)
            key = "send/cp" if mode == "ring" else "all_to_all/cp"
            assert rank["record"]["comm_bytes_by_op"][key] == model.n_layers * micro_batches * (forward + backward)


@pytest.mark.parametrize("world,layout", [lay for lay in LAYOUTS if "tp" not in lay[1] and "compile" not in lay[1]],
                         ids=lambda v: str(v))
def test_the_bytes_sent_over_the_context_parallel_group_are_the_rules(world, layout):
    """The ring's sends, Ulysses' all-to-alls: per rank and step, the layers x micro-batches x the
    (forward, backward) of rules/context.attention_traffic and what recomputation sends again
    (rules/context.recomputed_traffic); the ring's forward is 2(cp-1)/cp of the layer's K (|K| = |V|)."""
    model = get_preset("tiny").with_overrides(vocab_size=BASE["vocab_size"])
    cp, mode = layout["cp"], layout.get("cp_mode", "ring")
    tokens = BASE["micro_batch"] * BASE["seq_len"]
    forward, backward = attention_traffic(model, cp, mode, 1, tokens, 8, 8)
    if mode == "ring":
        keys = tokens * model.kv_heads * model.head_dim * 8
        assert forward == 2 * (cp - 1) / cp * keys
    layers = model.n_layers / layout.get("pp", 1)
    micro_batches = BASE["global_batch"] // BASE["micro_batch"] // layout.get("dp", 1)
    recomputed = recomputed_traffic(model, cp, mode, 1, tokens, 8, layout.get("checkpointing", "none"))
    if layout.get("checkpointing") == "selective":  # Ulysses: all but the output's exchange
        assert 0 < recomputed < forward
    expected = layers * micro_batches * (forward + backward + recomputed)
    key = "send/cp" if mode == "ring" else "all_to_all/cp"
    for rank in parallel_run(world, _key(**layout)):
        counted = rank["record"]["comm_bytes_by_op"]
        assert counted[key] == pytest.approx(expected, rel=1e-12), counted
        assert not [k for k in counted if k.endswith("/cp") and k != key], counted


# --- a sliding window and ALiBi ------------------------------------------------------------------
def _narrow_window_mistral():
    """A Mistral whose 4 heads (2 KV heads) split every way the layouts need, with a window of 6:
    under cp 2 (chunks of 8) and cp 4 (chunks of 4) some blocks lie wholly outside it, some
    partly, and some rows of a block see none of its keys."""
    import transformers
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=251, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        sliding_window=6)
    return transformers.AutoModelForCausalLM.from_config(config).float()


@functools.lru_cache(maxsize=None)
def converted(case: str, root: str) -> str:
    (_narrow_window_mistral() if case == "mistral-window-6" else hf_model(case)).save_pretrained(f"{root}/{case}/hf")
    assert strata_main(["convert", "--from-hf", f"{root}/{case}/hf", "--out", f"{root}/{case}/ck"]) == 0
    return f"{root}/{case}/ck"


def _family_losses(jobs):
    return [fp64_losses(checkpoint, **layout) for checkpoint, layout in jobs]


WINDOWED = [(2, dict(cp=2)), (2, dict(cp=2, cp_mode="ulysses")), (4, dict(cp=4)), (4, dict(cp=4, cp_mode="ulysses")),
            (4, dict(dp=2, cp=2, zero=1)), (4, dict(cp=2, tp=2, sequence_parallel=True)), (4, dict(cp=2, pp=2))]


def test_a_sliding_window_and_alibi_reproduce_the_single_process_run(tmp_path):
    """Converted from random-weight transformers models: a Mistral with a window of 6 under every
    layout of the causal test above (cp 2 and 4 by ring and Ulysses, dp2 x cp2, tp2 x cp2,
    cp2 x pp2); Mistral's window of 16 (chunks of 8 under cp 2, of 4 under cp 4) and BLOOM's six
    ALiBi heads under ring and Ulysses: fp64 losses within 1e-10 of one process."""
    cases = ("mistral-window-6", "mistral", "bloom")
    checkpoints = {case: converted(case, str(tmp_path)) for case in cases}
    reference = {case: fp64_losses(ck) for case, ck in checkpoints.items()}
    jobs = [(world, "mistral-window-6", layout) for world, layout in WINDOWED]
    jobs += [(world, case, layout) for case in ("mistral", "bloom")
             for world, layout in ((2, dict(cp=2)), (2, dict(cp=2, cp_mode="ulysses")), (4, dict(cp=4)))]
    for world in (2, 4):
        mine = [(case, layout) for w, case, layout in jobs if w == world]
        got = run_on_ranks(_family_losses, world, [(checkpoints[case], layout) for case, layout in mine], timeout=600)
        for rank in got:
            for (case, layout), losses in zip(mine, rank):
                torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[case]), rtol=1e-10, atol=0,
                                           msg=f"{case} {layout}")


# --- activations --------------------------------------------------------------------------------
def _saved_bytes_per_layer(**settings) -> float:
    """What one block keeps for backward in one forward (micro-batch 2, 64 tokens, fp64): a 4-block
    model's count minus a 2-block model's, over 2 (what all layers share, as the rotary tables of
    the rank's positions, cancels)."""
    counts = []
    for layers in (4, 2):
        run = trainer.setup(train_config(**{**BASE, "seq_len": 64, "n_layers": layers, "global_batch": 2, **settings}))
        inputs, targets = run.train_data.batch(0)
        with count_saved_activations(run.model) as saved:
            run.model(inputs, targets)
        counts.append(saved.bytes)
    return (counts[0] - counts[1]) / 2


def _per_layer_jobs(layouts):
    return [_saved_bytes_per_layer(**layout) for layout in layouts]


def test_a_layer_keeps_one_cp_th_of_the_activations():
    """Ring: exactly 1/cp of one rank's per-layer bytes; Ulysses: 1/cp plus its head-split output
    and repeated K/V (rules/context.extra_activation_elements)."""
    model = get_preset("tiny").with_overrides(vocab_size=BASE["vocab_size"])
    whole = _saved_bytes_per_layer()
    for world in (2, 4):
        layouts = [dict(cp=world), dict(cp=world, cp_mode="ulysses")]
        for rank in run_on_ranks(_per_layer_jobs, world, layouts, timeout=600):
            ring, ulysses = rank
            assert ring == whole / world, (world, ring, whole)
            extra = extra_activation_elements(model, world, "ulysses", 1, 2 * 64) * 8
            assert ulysses == whole / world + extra, (world, ulysses, whole, extra)


# --- checkpoints and generation -----------------------------------------------------------------
def _train_jobs(jobs):
    return [train(train_config(**{**BASE, "dtype": "fp32", **job}))["losses"] for job in jobs]


def test_checkpoints_cross_between_cp_layouts_and_one_process(tmp_path):
    """Saved at step 3 under cp 2 (ring), resumed under one process and under cp 4 with Ulysses;
    saved by one process, resumed under cp 2: every run continues with the uninterrupted losses (fp32)."""
    save = dict(save_every=3)
    reference, = _train_jobs([{"save": str(tmp_path / "one"), **save}])
    under_cp2, from_one = run_on_ranks(_train_jobs, 2, [{"cp": 2, "save": str(tmp_path / "cp2"), **save},
                                                        {"cp": 2, "resume": str(tmp_path / "one" / "step_000003")}],
                                       timeout=600)[0]
    to_one, = _train_jobs([{"resume": str(tmp_path / "cp2" / "step_000003")}])
    to_cp4, = run_on_ranks(_train_jobs, 4, [{"cp": 4, "cp_mode": "ulysses",
                                             "resume": str(tmp_path / "cp2" / "step_000003")}], timeout=600)[0]
    torch.testing.assert_close(under_cp2, reference, rtol=1e-5, atol=0)
    for name, got in (("cp2 <- one", from_one), ("one <- cp2", to_one), ("cp4 <- cp2", to_cp4)):
        torch.testing.assert_close(got, reference[3:], rtol=1e-5, atol=0, msg=name)


def test_a_model_trained_under_cp_generates_what_one_trained_in_one_process_does(tmp_path):
    """`strata train --nproc 2 --cp 2` as a user types it (torchrun, two processes), then `strata
    generate` from its checkpoint: the same greedy tokens as from the one-process run's."""
    common = ["train", "--model", "tiny", "--steps", "4", "--seq-len", "32", "--micro-batch", "2",
              "--global-batch", "4", "--dtype", "fp64", "--lr", "3e-3", "--no-progress", "--eval-batches", "1"]
    one = run_strata(*common, "--save", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-2000:]
    two = run_strata(*common, "--nproc", "2", "--cp", "2", "--save", str(tmp_path / "cp2"))
    assert two.returncode == 0, two.stderr[-2000:]
    tokens = {name: greedy_tokens(str(tmp_path / name)) for name in ("one", "cp2")}
    assert len(tokens["one"].split()) == len(PROMPT_IDS.split(",")) + NEW_TOKENS, tokens
    assert tokens["cp2"] == tokens["one"]
    validation = [[line for line in run.stdout.splitlines() if "validation loss" in line] for run in (one, two)]
    assert validation[0] == validation[1] and len(validation[0]) >= 2, validation


def test_a_rotary_model_goes_on_training_with_a_longer_context(tmp_path):
    """--max-seq-len lengthens the context of a rotary model (its weights do not depend on it),
    also from --init-from a checkpoint trained shorter; a learned position table cannot grow."""
    short = dict(model="tiny", steps=2, progress=False, eval_batches=1, micro_batch=1, global_batch=2, seq_len=64,
                 peak_flops=1e10)
    train(train_config(**short, save=str(tmp_path / "short")))
    longer = train(train_config(**{**short, "seq_len": 128}, max_seq_len=128, init_from=str(tmp_path / "short")))
    assert longer["model"].cfg.max_seq_len == 128 and len(longer["losses"]) == 2
    train(train_config(**{**short, "model": "tiny-gpt2"}, save=str(tmp_path / "learned")))
    result = run_strata("train", "--init-from", str(tmp_path / "learned"), "--max-seq-len", "128", "--steps", "1")
    assert result.returncode == 2
    assert result.stderr.strip() == ("strata: error: --max-seq-len 128: not with --init-from a model with learned "
                                     "positions: its position table has 64 rows"), result.stderr


# --- the ring's block kernels ---------------------------------------------------------------------
@pytest.mark.parametrize("window,alibi,kv_heads", [(None, False, 4), (5, False, 2), (None, True, 4), (11, True, 4)])
@pytest.mark.parametrize("kernel", ["fused", "blockwise"])
def test_the_rings_blocks_merge_to_attention_over_the_whole_sequence(kernel, window, alibi, kv_heads):
    """Every rank's two chunks of queries (cp 4, 32 positions: chunks of 4) against every rank's
    K/V blocks, block by block as the ring computes them (either kernel: the fused CPU one, and the
    blockwise one other devices use), merged by log-sum-exp: the output and the gradients of q, k
    and v equal one attention over the whole sequence (fp64); with a window some blocks are wholly
    outside it and some rows of a block see none of its keys (window 11: positions 24-27 against
    12-15); grouped-query attention's K/V gradients summed over the query heads reading them."""
    from strata.model import attention_blocks
    from strata.model.layers import alibi_slopes, attention_bias
    from strata.parallel import ring_attention as ring
    torch.manual_seed(0)
    heads, seq = 4, 32
    slopes = alibi_slopes(heads) if alibi else None
    q = torch.randn(2, heads, seq, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, seq, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = attention_bias(seq, 0, None, slopes, torch.float64, "cpu", window)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                                 enable_gqa=kv_heads != heads)
    grad = torch.randn_like(reference)
    reference.backward(grad)
    kind = {"fused": attention_blocks.CpuFlash, "blockwise": attention_blocks.Blockwise}[kernel]
    got = ring.blocks_in_one_process(q.detach(), k.detach(), v.detach(), grad, 4, window, slopes, kind)
    for name, ours, theirs in zip(("out", "dq", "dk", "dv"), got, (reference, q.grad, k.grad, v.grad)):
        torch.testing.assert_close(ours, theirs.detach(), rtol=1e-10, atol=1e-12, msg=name)
