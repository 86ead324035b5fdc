"""Every model family under tensor, pipeline and data parallelism, driven by its description alone:
the converted random-weight models of test_families (a vocabulary of 251 that no degree divides,
one KV head where the family allows it so tp 2 keeps K and V whole, Qwen3's per-head norms, BLOOM's
six ALiBi heads sliced three per rank, Gemma's wide heads, Mistral's window of 16 inside 32-token
sequences, GPT-NeoX's and GPT-J's own parallel blocks) give the same 40 greedy tokens under one
process, --tp 2 and --pp 2, and the same six fp64 training losses (within 1e-10) under --tp 2, --pp 2
and dp 2 x tp 2 with ZeRO-1 (the own blocks also under --cp 2, --tp 2 --sp with selective
checkpointing, and ZeRO-3)."""

import functools

import pytest
import torch
from family_runs import NEW_TOKENS, PROMPT_IDS, fp64_losses, greedy_tokens, on_each_rank
from hf_cases import CASES, grid_configs, hf_model

from strata.cli import main as strata_main

from distributed import run_on_ranks

LAYOUTS = {"tp2": (2, dict(tp=2)), "pp2": (2, dict(pp=2)), "dp2xtp2-zero1": (4, dict(dp=2, tp=2, zero=1))}


@functools.lru_cache(maxsize=None)
def converted_checkpoint(case: str, root: str) -> str:
    hf_model(case).save_pretrained(f"{root}/{case}/hf")
    assert strata_main(["convert", "--from-hf", f"{root}/{case}/hf", "--out", f"{root}/{case}/ck"]) == 0
    return f"{root}/{case}/ck"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("families"))


@functools.lru_cache(maxsize=None)
def single_process(case: str, root: str) -> tuple[list[float], str]:
    checkpoint = converted_checkpoint(case, root)
    return fp64_losses(checkpoint), greedy_tokens(checkpoint)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_a_family_under_parallelism_reproduces_one_process(case, layout, root):
    losses, tokens = single_process(case, root)
    assert len(tokens.split()) == len(PROMPT_IDS.split(",")) + NEW_TOKENS, tokens
    world, settings = LAYOUTS[layout]
    ranks = run_on_ranks(on_each_rank, world, converted_checkpoint(case, root), settings, timeout=300)
    for rank_losses, _ in ranks:
        torch.testing.assert_close(torch.tensor(rank_losses, dtype=torch.float64),
                                   torch.tensor(losses, dtype=torch.float64), rtol=1e-10, atol=0)
    if layout != "dp2xtp2-zero1":
        printed = [rank_tokens for _, rank_tokens in ranks if rank_tokens]
        assert printed == [tokens], (printed, tokens)


# A family's own block (GPT-NeoX's and GPT-J's parallel block) under the placements the layouts
# above leave out: context parallelism's ring in place of the block's core attention, sequence
# parallelism (GPT-J's one norm gathering the sequence once for q, k, v and the MLP) with selective
# checkpointing's hook on the same core, ZeRO-3 gathering each block as one unit.
OWN_BLOCK_CASES = ["gpt_neox", "gptj"]
OWN_BLOCK_LAYOUTS = {"cp2": (2, dict(cp=2)),
                     "tp2-sp-selective": (2, dict(tp=2, sequence_parallel=True, checkpointing="selective")),
                     "dp2-zero3": (2, dict(dp=2, zero=3))}


@pytest.mark.parametrize("layout", OWN_BLOCK_LAYOUTS)
@pytest.mark.parametrize("case", OWN_BLOCK_CASES)
def test_an_own_block_under_context_sequence_and_zero3_parallelism_reproduces_one_process(case, layout, root):
    losses, _ = single_process(case, root)
    world, settings = OWN_BLOCK_LAYOUTS[layout]
    ranks = run_on_ranks(on_each_rank, world, converted_checkpoint(case, root), settings, timeout=300)
    for rank_losses, _ in ranks:
        torch.testing.assert_close(torch.tensor(rank_losses, dtype=torch.float64),
                                   torch.tensor(losses, dtype=torch.float64), rtol=1e-10, atol=0)


GRID_CASES = [case for case in CASES if case in ("llama3.1", "qwen2", "mistral", "gpt2", "bloom", "gpt_neox", "gptj")] + \
    list(grid_configs())


@pytest.mark.parametrize("case", GRID_CASES)
def test_a_family_under_2d_tensor_parallelism_reproduces_one_process(case, root):
    """2-D tensor parallelism on 4 ranks, from the description's 1-D placements alone: tied heads
    (GPT-2, BLOOM, Llama 3.1's case), ALiBi's per-head slopes, BLOOM's embedding norm, Mistral's
    window, Qwen2's q/k/v biases, Qwen3's per-head norms, Gemma's (1 + w) norm, GPT-NeoX's and GPT-J's
    parallel blocks (GPT-J's one norm read by both branches' grid layers). (A model with fewer
    KV heads than q is refused under 2-D: each rank computes its own KV heads.)"""
    losses, _ = single_process(case, root)
    ranks = run_on_ranks(on_each_rank, 4, converted_checkpoint(case, root), dict(tp=4, tp_mode="2d"), timeout=300)
    for rank_losses, _ in ranks:
        torch.testing.assert_close(torch.tensor(rank_losses, dtype=torch.float64),
                                   torch.tensor(losses, dtype=torch.float64), rtol=1e-10, atol=0)


def test_alibi_under_3d_tensor_parallelism_takes_each_ranks_own_heads_slopes(root):
    """3-D computes the heads along j, while the residual stream's features lie along i: ALiBi's
    per-head slopes must follow the heads (on 2-D the two indices are the same)."""
    losses, _ = single_process("bloom", root)
    layout = dict(tp=8, tp_mode="3d", micro_batch=4)  # 3-D splits a micro-batch's sequences q² = 4 ways
    ranks = run_on_ranks(on_each_rank, 8, converted_checkpoint("bloom", root), layout, timeout=300)
    for rank_losses, _ in ranks:
        torch.testing.assert_close(torch.tensor(rank_losses, dtype=torch.float64),
                                   torch.tensor(losses, dtype=torch.float64), rtol=1e-10, atol=0)
