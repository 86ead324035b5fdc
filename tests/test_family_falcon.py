"""Falcon's and StarCoder's (GPTBigCode's) own tests. Their main cases (tests/hf_cases.py: Falcon-40B's
new decoder architecture with one KV group, StarCoder's multi-query block) run through
test_families.py and test_family_parallel.py; here: the layouts the main cases leave out, each
against transformers (logits) and back (bit for bit): Falcon's KV groups (3 of 2 heads each, with
biases and an untied head), Falcon-7B's multi-query block with one norm, the first releases'
sequential multi-head block, the new architecture with one norm, StarCoder without multi-query;
the fused layout rule they share; the KV cache's greedy tokens; context parallelism; the presets'
counts; and the options refused in one line."""

import dataclasses
import json

import pytest
import torch
import transformers
from family_runs import fp64_losses
from hf_cases import VOCAB, assert_refused_in_one_line, random_model, sharp_and_converted
from safetensors.torch import load_file

from strata.checkpoint.hf import hf_config_from_model, model_config_from_hf
from strata.cli import main as strata_main
from strata.infer.session import load_for_inference
from strata.model.families.base import join_per_head, split_per_head
from strata.model.families.falcon import join_per_group, split_per_group
from strata.model.presets import PRESETS
from strata.model.transformer import build_model

from distributed import run_on_ranks

FALCON = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, ffn_hidden_size=80, max_position_embeddings=64,
              bos_token_id=1, eos_token_id=2)
BIGCODE = dict(vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=6, n_positions=64, n_inner=80, bos_token_id=1,
               eos_token_id=2)


def variants():
    t = transformers
    return {
        # 6 heads in 3 KV groups of 2: the per-group layout where a group is neither one head nor all
        "falcon-groups": t.FalconConfig(**FALCON, num_attention_heads=6, num_kv_heads=3, new_decoder_architecture=True,
                                        bias=True, tie_word_embeddings=False, activation="gelu_pytorch_tanh"),
        "falcon-7b-style": t.FalconConfig(**FALCON, num_attention_heads=4, multi_query=True, parallel_attn=True),
        "falcon-sequential": t.FalconConfig(**FALCON, num_attention_heads=4, multi_query=False, parallel_attn=False,
                                            bias=True),
        "falcon-one-norm": t.FalconConfig(**FALCON, num_attention_heads=4, num_kv_heads=2,
                                          new_decoder_architecture=True, num_ln_in_parallel_attn=1),
        "gpt_bigcode-mha": t.GPTBigCodeConfig(**BIGCODE, multi_query=False),
    }



# --- each layout against transformers, and back -----------------------------------------------------
@pytest.mark.parametrize("case", list(variants()))
def test_a_layout_gives_transformers_logits_and_goes_back_bit_for_bit(case, tmp_path):
    theirs = random_model(variants()[case])
    theirs.save_pretrained(tmp_path / "hf")
    assert strata_main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 0
    ours, _ = load_for_inference(str(tmp_path / "ck"))
    prompt = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = theirs(prompt).logits
        assert ((ours(prompt) - expected).abs().max() / expected.abs().max()).item() < 1e-4
    assert ours.cfg.num_params() == theirs.num_parameters()
    assert strata_main(["convert", "--to-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "back")]) == 0
    original, back = load_file(str(tmp_path / "hf" / "model.safetensors")), \
        load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) == set(original) and all(torch.equal(back[name], value) for name, value in original.items())
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert model_config_from_hf(written, case) == ours.cfg


def test_the_per_group_layout_is_multi_query_with_one_group_and_per_head_with_a_group_per_head():
    """Falcon's fused rows (kv_heads, heads/kv_heads + 2, head_dim): with one group StarCoder's and
    Falcon-7B's [q, k, v]; with a group per head BLOOM's and GPT-NeoX's per-head layout; with 3
    groups of 2 heads group g's queries are heads 2g and 2g + 1; joined back bit for bit."""
    heads, head_dim = 6, 4
    rows = torch.arange(8 * head_dim, dtype=torch.float64)[:, None].expand(-1, 3)  # one group: 6 + 2 heads
    q, k, v = split_per_group(rows, 1, heads, head_dim)
    assert torch.equal(torch.cat([q, k, v]), rows) and k[0, 0] == 6 * head_dim
    per_head = torch.arange(3 * heads * head_dim, dtype=torch.float64)[:, None]
    assert all(torch.equal(a, b) for a, b in zip(split_per_group(per_head, heads, heads, head_dim),
                                                 split_per_head(per_head, heads, head_dim)))
    grouped = torch.arange(3 * 4 * head_dim, dtype=torch.float64)  # 3 groups of (2 q heads, k, v); a bias
    q, k, v = split_per_group(grouped, 3, heads, head_dim)
    assert q.view(heads, head_dim)[:, 0].tolist() == [0, 4, 16, 20, 32, 36]  # group 1's queries start at row 16
    assert k.view(3, head_dim)[:, 0].tolist() == [8, 24, 40] and v.view(3, head_dim)[:, 0].tolist() == [12, 28, 44]
    assert torch.equal(join_per_group(q, k, v, 3, head_dim), grouped)
    assert torch.equal(join_per_group(*split_per_head(per_head, heads, head_dim), heads, head_dim),
                       join_per_head(*split_per_head(per_head, heads, head_dim), heads, head_dim))


@pytest.mark.parametrize("case", ["falcon", "gpt_bigcode"])
def test_context_parallelism_reproduces_one_process(case, tmp_path):
    """--cp 2: the ring in place of the block's core attention over multi-query K/V (Falcon's own
    block with rotary positions, StarCoder's shared one with learned positions): six fp64 losses
    equal one process's to 1e-10."""
    sharp_and_converted(case, tmp_path)
    checkpoint = str(tmp_path / "ck")
    losses = fp64_losses(checkpoint)
    for rank_losses in run_on_ranks(fp64_losses, 2, checkpoint, cp=2, timeout=300):
        torch.testing.assert_close(torch.tensor(rank_losses, dtype=torch.float64),
                                   torch.tensor(losses, dtype=torch.float64), rtol=1e-10, atol=0)


# --- presets ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,layout", [
    ("falcon-7b", {"new_decoder_architecture": False, "multi_query": True, "parallel_attn": True}),
    ("falcon-40b", {"new_decoder_architecture": True, "num_kv_heads": 8, "num_ln_in_parallel_attn": 2}),
    ("starcoder", {"multi_query": True}),
])
def test_preset_counts_equal_transformers_on_the_meta_device(name, layout):
    cfg = PRESETS[name]
    hf = hf_config_from_model(cfg, None)
    assert layout.items() <= hf.items()
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert cfg.num_params() == model.num_parameters() == sum(p.numel() for p in build_model(cfg, seed=None).parameters())
    # FLOPs count the matrices of transformers' block (the fused q/k/v's rows: K/V heads, not heads)
    matrices = sum(p.numel() for p in model.base_model.h[0].parameters() if p.dim() == 2)
    assert cfg.block_matmul_params() == matrices


PUBLISHED = {"falcon-7b": 6_921_720_704, "falcon-40b": 41_303_293_952, "starcoder": 15_517_456_384}


def test_presets_have_the_published_counts():
    assert {name: PRESETS[name].num_params() for name in PUBLISHED} == PUBLISHED


# Falcon-7B's released config.json (transformers' format): no max_position_embeddings, ffn_hidden_size
# nor num_kv_heads (FalconConfig's defaults: 2,048, 4 x hidden, one K/V head under multi_query)
RELEASED_FALCON_7B = {"alibi": False, "apply_residual_connection_post_layernorm": False, "architectures":
                      ["FalconForCausalLM"], "attention_dropout": 0.0, "bias": False, "bos_token_id": 11,
                      "eos_token_id": 11, "hidden_dropout": 0.0, "hidden_size": 4544, "initializer_range": 0.02,
                      "layer_norm_epsilon": 1e-05, "model_type": "falcon", "multi_query": True,
                      "new_decoder_architecture": False, "num_attention_heads": 71, "num_hidden_layers": 32,
                      "parallel_attn": True, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 65024}


def test_falcon_7b_released_config_json_reads_as_the_preset():
    assert model_config_from_hf(RELEASED_FALCON_7B, "falcon-7b") == PRESETS["falcon-7b"]


# --- what is refused ----------------------------------------------------------------------------------
@pytest.mark.parametrize("case,change,needle", [
    ("falcon", {"alibi": True}, "alibi=True is not supported"),
    ("falcon", {"parallel_attn": False}, "parallel_attn=False is not supported with new_decoder_architecture"),
    ("falcon", {"num_ln_in_parallel_attn": 3}, "num_ln_in_parallel_attn=3 is not supported"),
    ("falcon", {"new_decoder_architecture": False, "multi_query": True, "num_ln_in_parallel_attn": 2},
     "num_ln_in_parallel_attn=2 is not supported without new_decoder_architecture"),
    ("falcon", {"new_decoder_architecture": False, "multi_query": False, "num_kv_heads": 2},
     "num_kv_heads=2 is not supported without multi_query"),
    ("falcon", {"activation": "relu"}, "activation='relu' is not supported"),
    ("falcon", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_type 'linear'"),
    ("gpt_bigcode", {"scale_attn_weights": False}, "scale_attn_weights=False is not supported"),
    ("gpt_bigcode", {"tie_word_embeddings": False}, "tie_word_embeddings=False is not supported"),
    ("gpt_bigcode", {"activation_function": "gelu"}, "activation_function='gelu' is not supported"),
    ("gpt_bigcode", {"add_cross_attention": True}, "add_cross_attention=True is not supported"),
])
def test_unsupported_options_are_one_line_naming_the_key(case, change, needle, tmp_path, capsys):
    assert_refused_in_one_line(case, change, needle, tmp_path, capsys)


@pytest.mark.parametrize("change,needle", [
    ({"parallel_attn": False, "norms": 1, "bias": False, "activation": "gelu"}, "norms=1 is not a valid int"),
    ({"parallel_attn": True, "norms": 3, "bias": False, "activation": "gelu"}, "norms=3 is not a valid int"),
    ({"parallel_attn": True, "norms": 2, "bias": 0, "activation": "gelu"}, "bias=0 is not a valid bool"),
    ({"parallel_attn": True, "norms": 2, "bias": False}, "'activation' is missing"),
])
def test_falcon_options_are_checked(change, needle):
    with pytest.raises(ValueError, match=needle):
        dataclasses.replace(PRESETS["falcon-40b"], family_options=change).validate()
