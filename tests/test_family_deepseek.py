"""DeepSeek-V2/V3's multi-head latent attention (strata/model/latent_attention.py,
families/deepseek_v3.py), dense layers: the pieces against transformers' own functions (the
interleaved rotation of V3 and V2, the halves), the variants the main case (tests/hf_cases.py:
a query latent, interleaved pairs, values narrower than keys) leaves out (DeepSeek-V2 with a plain
q_proj; V3 with rotation on halves and values wider than keys) against transformers' logits and
back bit for bit, greedy tokens through the decompressed KV cache, context and sequence
parallelism (values padded to the queries' width for the ring), the one-line refusals, and the
serving planner's latent cache.
The main case's logits, round trip, counts and tp/pp/dp layouts: test_families.py,
test_family_parallel.py."""

import dataclasses
import json

import pytest
import torch
import transformers
from family_runs import fp64_losses, on_each_rank
from hf_cases import SMALL, VOCAB, assert_refused_in_one_line, hf_configs, hf_model, random_model
from safetensors.torch import load_file

from strata.checkpoint.hf import hf_config_from_model, model_config_from_hf
from strata.cli import main as strata_main
from strata.errors import ConfigError
from strata.infer.session import load_for_inference
from strata.model.families import deepseek_v3
from strata.model.latent_attention import LatentAttention, rotary_tables
from strata.model.presets import PRESETS
from strata.model.transformer import build_model
from strata.plan.inference import attention_flops, kv_cache_bytes

from distributed import run_on_ranks

LATENT = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
              first_k_dense_replace=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
VARIANTS = {
    # DeepSeek-V2(-Lite): queries from one q_proj, RoPE as complex pairs (kept interleaved)
    "deepseek_v2-q_proj": transformers.DeepseekV2Config(**SMALL, **LATENT, q_lora_rank=None, v_head_dim=6),
    # V3 rotating halves, with value heads (16) wider than query/key heads (12)
    "deepseek_v3-halves-wide-v": transformers.DeepseekV3Config(**SMALL, **LATENT, q_lora_rank=24, v_head_dim=16,
                                                               rope_interleave=False),
    # DeepSeek-V2's mixture after a dense first layer: softmax scores, 2 of 8 experts from the 2 best of
    # 4 groups (group_limited_greedy), not renormalised, times 1.5; one shared expert
    "deepseek_v2-moe": transformers.DeepseekV2Config(**SMALL, **{**LATENT, "first_k_dense_replace": 1}, q_lora_rank=None,
                                                     v_head_dim=6, n_routed_experts=8, num_experts_per_tok=2,
                                                     n_shared_experts=1, moe_intermediate_size=16, n_group=4,
                                                     topk_group=2, topk_method="group_limited_greedy",
                                                     routed_scaling_factor=1.5),
}


def strata_config(config):
    return model_config_from_hf(config.to_dict(), "test")



# --- the rotation against transformers' --------------------------------------------------------------
def test_the_rotations_are_transformers_v3_and_v2s():
    """V3's interleaved rotation returns the pairs' evens first (apply_rotary_pos_emb_interleave):
    strata's equals it; V2's complex rotation keeps the pairs in place: strata's is the same numbers
    permuted, so q·k is V2's; rope_interleave false rotates halves (apply_rotary_pos_emb)."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3
    q, k = torch.randn(2, 2, 4, 5, 4, generator=torch.Generator().manual_seed(0))  # (batch, heads, seq, rope)
    positions = torch.arange(5)[None]
    for interleaved in (False, True):  # V3's interleaved last: V2's is held to it below
        config = VARIANTS["deepseek_v3-halves-wide-v"] if not interleaved else hf_configs()["deepseek_v3"]
        cfg = strata_config(config)
        cos, sin = v3.DeepseekV3RotaryEmbedding(config)(q, positions)
        rotate = v3.apply_rotary_pos_emb_interleave if interleaved else v3.apply_rotary_pos_emb
        expected = rotate(q, k, cos, sin)
        ours_cos, ours_sin = (t[:5].float() for t in rotary_tables(cfg, deepseek_v3.block_shape(cfg)))
        attention = LatentAttention(cfg, deepseek_v3.block_shape(cfg))
        ours = [attention.rotate(t, ours_cos, ours_sin) for t in (q, k)]
        for mine, theirs in zip(ours, expected):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    config = VARIANTS["deepseek_v2-q_proj"]
    q_v2, k_v2 = v2.apply_rotary_emb(q, k, v2.DeepseekV2RotaryEmbedding(config)(q, positions))
    torch.testing.assert_close(torch.cat([q_v2[..., 0::2], q_v2[..., 1::2]], dim=-1), expected[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(q_v2 @ k_v2.transpose(-1, -2), expected[0] @ expected[1].transpose(-1, -2),
                               rtol=0, atol=1e-5)


# --- the variants against transformers ----------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_variants_logits_equal_transformers_and_it_goes_back_bit_for_bit(variant, tmp_path):
    theirs = random_model(VARIANTS[variant])
    theirs.save_pretrained(tmp_path / "hf")
    assert strata_main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 0
    ours, _ = load_for_inference(str(tmp_path / "ck"))
    assert ours.cfg.num_params() == theirs.num_parameters()
    for length in (3, 40):
        tokens = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            expected = theirs(tokens).logits
            assert ((ours(tokens) - expected).abs().max() / expected.abs().max()).item() < 1e-4, length
    assert strata_main(["convert", "--to-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "back")]) == 0
    original, back = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "back"))
    assert set(back) == set(original) and all(torch.equal(back[name], value) for name, value in original.items())
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["model_type"] == VARIANTS[variant].model_type


# --- generation through the block's own cache ---------------------------------------------------------
def test_the_kv_cache_holds_keys_and_values_of_their_own_widths():
    """Keys 12 wide and values 6 wide per head (the decompressed cache; tokens through it equal
    transformers': test_own_blocks)."""
    keys, values = build_model(strata_config(hf_configs()["deepseek_v3"]), seed=None).layers()[0].empty_kv_cache(2, 9)
    assert keys.shape == (2, 4, 9, 12) and values.shape == (2, 4, 9, 6)


# --- a replaced core sees equal widths ------------------------------------------------------------------
@pytest.mark.parametrize("config", [hf_configs()["deepseek_v3"], VARIANTS["deepseek_v3-halves-wide-v"]])
def test_padding_to_equal_widths_changes_neither_output_nor_gradients(config):
    """Values narrower (6 < 12) or wider (16 > 12) than queries: a replaced core (the ring, which
    sends K and V stacked and merges outputs as wide as q) is given equal widths, zeros added to the
    narrower (and q scaled by sqrt(16/12) to keep the softmax scale); the cut result is the same."""
    cfg = strata_config(config)
    torch.manual_seed(0)
    attention = LatentAttention(cfg, deepseek_v3.block_shape(cfg)).double()
    cos, sin = rotary_tables(cfg, deepseek_v3.block_shape(cfg))
    x = torch.randn(2, 9, cfg.d_model, dtype=torch.float64)
    widths = []
    attention.core = lambda q, k, v, bias, core=attention.core: widths.append((q.shape[-1], v.shape[-1])) or \
        core(q, k, v, bias)

    def output_and_gradients(equal_widths: bool):
        attention.equal_widths = equal_widths
        attention.zero_grad()
        out = attention(x, (cos, sin))
        out.pow(2).sum().backward()
        return out.detach(), [p.grad.clone() for p in attention.parameters()]
    (out, grads), (padded_out, padded_grads) = output_and_gradients(False), output_and_gradients(True)
    qk, v = cfg.head_dim, deepseek_v3.block_shape(cfg).v_head_dim
    assert widths == [(qk, v), (max(qk, v), max(qk, v))]
    torch.testing.assert_close(padded_out, out, rtol=1e-10, atol=1e-14)
    for padded, plain in zip(padded_grads, grads):
        torch.testing.assert_close(padded, plain, rtol=1e-10, atol=1e-14)


def test_context_and_sequence_parallelism_reproduce_one_process(tmp_path):
    """cp 2 (the ring, its blocks given values padded to the queries' width) x tp 2 with sequence
    parallelism (the replicated down projections read the gathered sequence; their gradients are
    parts, summed) and selective checkpointing (its hook on the ring): six fp64 losses to 1e-10."""
    hf_model("deepseek_v3").save_pretrained(tmp_path / "hf")
    assert strata_main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 0
    checkpoint = str(tmp_path / "ck")
    losses = fp64_losses(checkpoint)
    layout = dict(cp=2, tp=2, sequence_parallel=True, checkpointing="selective")
    for rank_losses, _ in run_on_ranks(on_each_rank, 4, checkpoint, layout, timeout=300):
        torch.testing.assert_close(torch.tensor(rank_losses, dtype=torch.float64),
                                   torch.tensor(losses, dtype=torch.float64), rtol=1e-10, atol=0)


# --- refusals ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("change,needle", [
    ({"first_k_dense_replace": 1, "moe_layer_freq": 2}, "moe_layer_freq=2 is not supported; valid: 1"),
    ({"first_k_dense_replace": 1, "topk_method": "greedy"}, "topk_method='greedy' is not supported; valid: noaux_tc"),
    ({"first_k_dense_replace": 1, "model_type": "deepseek_v2", "norm_topk_prob": True},
     "norm_topk_prob=True is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 40.0, "rope_theta": 1e4, "mscale_all_dim": 1.0}},
     "rope_type 'yarn' is not supported"),
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2 is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"qk_rope_head_dim": 3}, "qk_rope_head_dim=3 is not supported (an even number"),
])
def test_unsupported_options_are_one_line_naming_the_key(change, needle, tmp_path, capsys):
    assert_refused_in_one_line("deepseek_v3", change, needle, tmp_path, capsys)


@pytest.mark.parametrize("change,needle", [
    ({"family_options": {"q_lora_rank": 24}}, "'kv_lora_rank' is missing"),
    ({"d_head": 16}, "d_head=16 must be qk_nope_head_dim \\+ qk_rope_head_dim = 12"),
    ({"n_kv_heads": 2}, "n_kv_heads=2: latent attention has a key and a value per query head"),
    ({"sliding_window": 8}, "sliding_window=8: a deepseek_v3 block does not compute it"),
    ({"norm": "layernorm"}, "norm='layernorm': a deepseek_v3 block does not compute it"),
    ({"bias": True}, "bias=True: a deepseek_v3 block does not compute it"),
])
def test_family_options_and_shared_fields_are_checked(change, needle):
    with pytest.raises(ValueError, match=needle):
        dataclasses.replace(strata_config(hf_configs()["deepseek_v3"]), **change).validate()


def test_a_v2_file_cannot_hold_rotation_on_halves():
    """DeepSeek-V2's config.json has no rope_interleave (it always pairs): exporting such a model as
    V2 would read back as another model, and is refused."""
    v2 = VARIANTS["deepseek_v2-q_proj"].to_dict()
    halves = strata_config(VARIANTS["deepseek_v3-halves-wide-v"])
    with pytest.raises(ConfigError, match="a deepseek_v3 config.json cannot hold this model's family_options"):
        hf_config_from_model(halves, v2)


# --- counts ----------------------------------------------------------------------------------------
def test_the_tiny_mla_preset_counts_what_transformers_counts_and_its_flops_count_every_matmul():
    cfg = PRESETS["tiny-mla"]
    hf = hf_config_from_model(cfg, None)
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert cfg.num_params() == model.num_parameters() == sum(p.numel() for p in build_model(cfg, seed=None).parameters())
    d, heads, q_latent, kv_latent, nope, rope, v = 64, 4, 32, 32, 16, 8, 16
    attention = d * q_latent + q_latent * heads * (nope + rope) + d * (kv_latent + rope) + \
        kv_latent * heads * (nope + v) + heads * v * d
    assert cfg.block_matmul_params() == attention + 3 * d * 128
    # the attention: scores over q/k heads nope + rope wide, values v wide, 6 FLOPs a product in training
    assert cfg.flops_per_token(32) == 6 * (2 * cfg.block_matmul_params() + d * 256) + 6 * 2 * heads * (24 + v) * 32


# --- the serving planner ---------------------------------------------------------------------------
def test_the_serving_planner_prices_the_latent_cache_whole_on_every_rank():
    """kv_lora_rank + qk_rope_head_dim = 20 numbers per token and layer (not 2 x 4 heads x 12),
    whole on every tensor-parallel rank; attention over the latent (DeepSeek's absorb mode)."""
    cfg = strata_config(hf_configs()["deepseek_v3"])
    assert kv_cache_bytes(cfg, 3, 10, "fp16") == 2 * 3 * 10 * (16 + 4) * 2
    assert kv_cache_bytes(cfg, 3, 10, "fp16", tp=2) == kv_cache_bytes(cfg, 3, 10, "fp16")
    assert attention_flops(cfg, 10) == 2 * 10 * 4 * (16 + 4 + 16)
