"""A family that brings its own block (strata/model/families/base.OwnBlock: GPT-NeoX's and GPT-J's
parallel block, strata/model/parallel_block.py): its rotary conventions against transformers' own
functions, every block's parameter list (the one the counts and the planner read) against its
modules, the family's options through a manifest and their checks, and what strata reaches through
the block's interface: the KV cache (greedy tokens, padded rows included, equal transformers'
generate) and selective checkpointing's hook on its core attention (counted recomputations).
Its conversion, logits, round trip and layouts: tests/test_families.py, test_family_parallel.py."""

import dataclasses
import json

import pytest
import torch
from hf_cases import VOCAB, assert_greedy_tokens_equal_transformers, hf_configs

from strata.checkpoint.hf import model_config_from_hf
from strata.memory.checkpointing import apply_checkpointing
from strata.model.config import ModelConfig
from strata.model.families import gpt_neox, gptj
from strata.model.parallel_block import PartialRotaryAttention, rotary_tables
from strata.model.presets import PRESETS
from strata.model.transformer import build_model


def strata_config(case: str) -> ModelConfig:
    return model_config_from_hf(hf_configs()[case].to_dict(), case)


# --- the pieces against transformers' ---------------------------------------------------------------
def test_gptj_rotates_the_first_rotary_dim_features_in_interleaved_pairs_as_transformers():
    from transformers.models.gptj import modeling_gptj as theirs
    cfg = strata_config("gptj")  # 4 heads of 12 features, rotary_dim 8
    shape = gptj.block_shape(cfg)
    x = torch.randn(2, 5, 4, 12, generator=torch.Generator().manual_seed(0))  # (batch, seq, heads, head_dim)
    sin, cos = torch.split(theirs.create_sinusoidal_positions(64, 8)[:5][None], 4, dim=-1)
    expected = torch.cat([theirs.apply_rotary_pos_emb(x[..., :8], sin, cos), x[..., 8:]], dim=-1)
    ours_cos, ours_sin = rotary_tables(cfg, shape)
    ours = PartialRotaryAttention(cfg, shape).rotate(x.transpose(1, 2), ours_cos[:5].float(), ours_sin[:5].float())
    torch.testing.assert_close(ours.transpose(1, 2), expected, rtol=0, atol=1e-6)
    assert torch.equal(ours.transpose(1, 2)[..., 8:], x[..., 8:])  # the last 4 features pass


@pytest.mark.parametrize("case,rotated", [("gpt_neox", 4), ("gpt_neox-sequential", 6)])
def test_gpt_neox_rotates_halves_of_its_first_features_as_transformers(case, rotated):
    """rotary_pct 0.25 of 16 features: 4; 0.3125: int(5.0) = 5, which transformers rotates as 6
    (three frequencies theta^(-2i/5)): strata's tables are as wide as transformers' cos."""
    from transformers.models.gpt_neox import modeling_gpt_neox as theirs
    config, cfg = hf_configs()[case], strata_config(case)
    shape = gpt_neox.block_shape(cfg)
    x = torch.randn(2, 4, 5, 16, generator=torch.Generator().manual_seed(0))  # (batch, heads, seq, head_dim)
    cos, sin = theirs.GPTNeoXRotaryEmbedding(config)(x, torch.arange(5)[None])
    expected, _ = theirs.apply_rotary_pos_emb(x, x, cos, sin)
    ours_cos, ours_sin = rotary_tables(cfg, shape)
    assert ours_cos.shape == (64, rotated) == (64, cos.shape[-1])
    ours = PartialRotaryAttention(cfg, shape).rotate(x, ours_cos[:5].float(), ours_sin[:5].float())
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


# --- counts ---------------------------------------------------------------------------------------
def test_every_blocks_parameter_list_is_its_modules_in_order():
    """ModelConfig.block_parameter_shapes (what unit_params counts and the planner can list) against
    the block strata builds, shared or a family's own, for every preset and every family's case."""
    configs = list(PRESETS.values()) + [strata_config(case) for case in hf_configs()]
    for cfg in configs:
        cfg = cfg.with_overrides(n_layers=1) if cfg.uniform_layers else cfg  # else every layer: they differ
        for layer, block in build_model(cfg, seed=None).layers().items():
            shapes = cfg.block_parameter_shapes(layer)
            assert [(name, tuple(p.shape)) for name, p in block.named_parameters()] == shapes
            if not cfg.layer_is_moe(layer):  # a mixture's multiplied weights are its active experts'
                assert cfg.block_matmul_params(layer) == sum(p.numel() for p in block.parameters() if p.dim() == 2)


def test_gptj_and_pythia_count_one_norm_and_no_attention_biases_where_they_have_none():
    gptj_block = dict(PRESETS["gpt-j-6b"].block_parameter_shapes())
    assert "mlp_norm.weight" not in gptj_block and "attn.wq.bias" not in gptj_block and "mlp.w_in.bias" in gptj_block
    pythia = dict(PRESETS["pythia-1.4b"].block_parameter_shapes())
    assert pythia["mlp_norm.bias"] == (2048,) and pythia["attn.wq.bias"] == (2048,)
    assert PRESETS["gpt-j-6b"].unit_params()[2] == 2 * 4096 + 50400 * 4096 + 50400  # ln_f, lm_head and its bias
    assert PRESETS["pythia-1.4b"].num_params() == 1_414_647_808  # Biderman et al. 2023, Table 6


# --- the options ----------------------------------------------------------------------------------
def test_family_options_travel_as_plain_data_through_a_manifest():
    cfg = PRESETS["pythia-1.4b"]
    assert cfg.family_options == (("attention_bias", True), ("hidden_act", "gelu"), ("parallel_residual", True),
                                  ("rotary_pct", 0.25))
    again = ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and hash(again) == hash(cfg)


@pytest.mark.parametrize("preset,change,needle", [
    ("pythia-1.4b", {"family_options": {"rotary_pct": 0.25}}, "'parallel_residual' is missing"),
    ("gpt-j-6b", {"family_options": {"rotary_dim": 64, "rotary_pct": 0.5}}, "'rotary_pct' is not one of them"),
    ("gpt-j-6b", {"family_options": {"rotary_dim": 63}}, "rotary_dim=63 is not a valid int"),
    ("pythia-1.4b", {"family_options": {"rotary_pct": 0.25, "parallel_residual": 1, "attention_bias": True,
                                        "hidden_act": "gelu"}}, "parallel_residual=1 is not a valid bool"),
    ("pythia-1.4b", {"family_options": {"rotary_pct": 0.25, "parallel_residual": True, "attention_bias": True,
                                        "hidden_act": "relu"}}, "hidden_act='relu' is not a valid str"),
    ("tiny", {"family_options": {"rotary_dim": 8}}, "family 'llama' has no block of its own"),
    ("gpt-j-6b", {"qk_norm": True}, "qk_norm=True: a gptj block does not compute it"),
    ("pythia-1.4b", {"mlp": "swiglu"}, "mlp='swiglu': a gpt_neox block does not compute it"),
])
def test_family_options_are_checked_by_their_family(preset, change, needle):
    with pytest.raises(ValueError, match=needle):
        dataclasses.replace(PRESETS[preset], **change).validate()


# --- what strata reaches through the block's interface ---------------------------------------------
# every block added since issue 55's first part, and StarCoder's multi-query on the shared one
@pytest.mark.parametrize("case", ["gpt_neox", "gptj", "falcon", "gpt_bigcode", "gemma2", "gemma3", "olmo2",
                                  "deepseek_v3", "deepseek_v3-moe"])
def test_greedy_tokens_through_the_kv_cache_equal_transformers_generate(case, tmp_path):
    """Rotary positions per row past the padding (partial, interleaved, latent), Gemma's local
    windows of 8 sliding over the cache (Gemma 3's own RoPE base), OLMo 2's whole-projection
    norms, MLA's decompressed keys and values, DeepSeek's routing by its bias: 40 tokens each (hf_cases)."""
    assert_greedy_tokens_equal_transformers(case, tmp_path)


@pytest.mark.parametrize("case", ["gpt_neox", "gptj", "gemma2"])
def test_selective_checkpointing_recomputes_the_own_blocks_core_attention(case):
    """The block's wrap_core_attention hook: each block's core runs twice in a step (the forward and
    backward's recomputation) under selective checkpointing, once without, and the gradients are
    the same bit for bit."""
    def step(mode: str) -> tuple[int, list[torch.Tensor]]:
        model = build_model(strata_config(case), dtype=torch.float64, seed=1)
        calls = []
        for block in model.layers().values():
            core = block.attn.core
            block.attn.core = lambda *args, core=core: calls.append(1) or core(*args)
        apply_checkpointing(model, mode)
        tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        return len(calls), [p.grad for p in model.parameters()]
    (plain_calls, plain), (selective_calls, selective) = step("none"), step("selective")
    assert (plain_calls, selective_calls) == (2, 4)  # 2 blocks
    assert all(torch.equal(a, b) for a, b in zip(plain, selective))


def test_own_blocks_count_their_own_attention_in_the_flops():
    """ModelConfig.attention_products through the block: Gemma 2 9B's 21 local layers attend at most
    their window of 4,096 (the global 21 the whole 8,192), MLA's scores run over q/k heads of 16 + 8
    features and its values over 16; a parallel block keeps the shared count (12·L·h·s)."""
    gemma, mla, pythia = PRESETS["gemma-2-9b"], PRESETS["tiny-mla"], PRESETS["pythia-1.4b"]
    products = 21 * 16 * 2 * 256 * 4096 + 21 * 16 * 2 * 256 * 8192
    assert gemma.flops_per_token(8192) == 6 * gemma.matmul_params() + 6 * products
    assert mla.flops_per_token(64) == 6 * mla.matmul_params() + 6 * 2 * 4 * (16 + 8 + 16) * 64
    assert pythia.flops_per_token(2048) == 6 * pythia.matmul_params() + 12 * 24 * 2048 * 2048
