"""DeepSeek-V3 and DeepSeek-V2 (DeepSeek-AI 2024; transformers' model_types "deepseek_v3" and
"deepseek_v2"): multi-head latent attention (strata/model/latent_attention.py) in a pre-norm block
with RMSNorm and SwiGLU, RoPE on qk_rope_head_dim features of each head in interleaved pairs
(V2 always; V3 unless rope_interleave is false), an untied head.

Dense layers only, for now: a config.json whose first_k_dense_replace leaves some layer a mixture
of routed experts is refused in one line naming the key (the MoE layers are not built yet), as
are YaRN's rope scaling (V3's released config) and biases on the attention. The MLA options
(q_lora_rank, 0 for a plain q_proj; kv_lora_rank; the nope, rope and v head widths;
rope_interleave) are the family's own (cfg.family_options, LatentOptions); d_head holds the
query/key head width, qk_nope_head_dim + qk_rope_head_dim.

Tensors are stored under Llama's names with the attention's own (self_attn.q_a_proj,
q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj; q_proj without a query
latent), every one only renamed."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from strata.errors import ConfigError
from strata.model.config import ModelConfig
from strata.model.families.base import (
    Family,
    OwnBlock,
    check_choice,
    check_option,
    default_rope_theta_from_hf,
    default_rope_to_hf,
    in_blocks,
    read_options,
    refuse_set,
)
from strata.model.families.llama import LAYER as LLAMA_LAYER
from strata.model.families.llama import tensors_from_hf, tensors_to_hf
from strata.model.latent_attention import LatentShape, described

NAME = "deepseek_v3"
MODEL_TYPES = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}
ATTENTION = {"self_attn.q_proj": "attn.wq", "self_attn.q_a_proj": "attn.wq_a", "self_attn.q_a_layernorm":
             "attn.q_a_norm", "self_attn.q_b_proj": "attn.wq_b", "self_attn.kv_a_proj_with_mqa": "attn.wkv_a",
             "self_attn.kv_a_layernorm": "attn.kv_a_norm", "self_attn.kv_b_proj": "attn.wkv_b",
             "self_attn.o_proj": "attn.wo"}
LAYER = {**{k: v for k, v in LLAMA_LAYER.items() if not k.startswith("self_attn.")}, **ATTENTION}
# Megatron-Core's MLA split (and DeepSeek's inference): the down projections and their norms whole on
# every rank, fed by the norm's one input conversion; they serve only this rank's heads, so their
# gradients are parts, summed over the group ("summed_replica").
# The up projections split by heads, the output projection by its input features.
TENSOR_PARALLEL = {"embed": "vocabulary", "head": "vocabulary", "final_norm": "input_norm",
                   **in_blocks({"attn_norm": "input_norm", "attn.wq_a": "summed_replica",
                                "attn.q_a_norm": "summed_replica", "attn.wq_b": "column", "attn.wq": "column",
                                "attn.wkv_a": "summed_replica", "attn.kv_a_norm": "summed_replica",
                                "attn.wkv_b": "column", "attn.wo": "row",
                                "mlp_norm": "input_norm", "mlp.w_gate": "column", "mlp.w_up": "column",
                                "mlp.w_down": "row"})}


@dataclass(frozen=True)
class LatentOptions:
    q_lora_rank: int  # 0: queries from one projection (q_proj), as DeepSeek-V2-Lite
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool


def block_shape(cfg: ModelConfig) -> LatentShape:
    o = read_options(cfg, LatentOptions)
    return LatentShape(o.q_lora_rank, o.kv_lora_rank, o.qk_nope_head_dim, o.qk_rope_head_dim, o.v_head_dim,
                       o.rope_interleave)


def check(cfg: ModelConfig) -> None:
    options = read_options(cfg, LatentOptions)
    check_option("q_lora_rank", options.q_lora_rank, int, lambda n: n >= 0)
    for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        check_option(name, getattr(options, name), int, lambda n: n >= 1)
    check_option("qk_rope_head_dim", options.qk_rope_head_dim, int, lambda n: n >= 2 and n % 2 == 0)
    check_option("rope_interleave", options.rope_interleave, bool)


# --- config.json ----------------------------------------------------------------------------------
def config_from_hf(hf: dict, where: str) -> ModelConfig:
    check_choice(hf, where, "hidden_act", ("silu",), "silu")
    refuse_set(hf, where, "attention_bias", "mlp_bias")
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    dense = hf.get("first_k_dense_replace", 3 if hf.get("model_type") == "deepseek_v3" else 0)  # the classes' defaults
    if not isinstance(dense, int) or dense < layers:
        raise ConfigError(f"{where}: config.json: first_k_dense_replace={dense!r} leaves layers of routed experts "
                          f"(num_hidden_layers={layers}): routed experts in DeepSeek layers are not built yet")
    if hf.get("num_key_value_heads") not in (None, heads):
        raise ConfigError(f"{where}: config.json: num_key_value_heads={hf['num_key_value_heads']!r} is not supported "
                          f"(latent attention has a key and a value per query head: {heads})")
    if not isinstance(hf["qk_rope_head_dim"], int) or hf["qk_rope_head_dim"] % 2:  # before d_head's own check
        raise ConfigError(f"{where}: config.json: qk_rope_head_dim={hf['qk_rope_head_dim']!r} is not supported "
                          f"(an even number: RoPE turns pairs of features)")
    options = LatentOptions(hf.get("q_lora_rank") or 0, hf["kv_lora_rank"], hf["qk_nope_head_dim"],
                            hf["qk_rope_head_dim"], hf["v_head_dim"],
                            hf.get("model_type") == "deepseek_v2" or bool(hf.get("rope_interleave", True)))
    return ModelConfig(vocab_size=hf["vocab_size"], n_layers=layers, d_model=hf["hidden_size"], n_heads=heads,
                       d_ff=hf["intermediate_size"], max_seq_len=hf["max_position_embeddings"],
                       d_head=options.qk_nope_head_dim + options.qk_rope_head_dim,
                       norm_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                       rope_theta=default_rope_theta_from_hf(hf, where), family=NAME, family_options=vars(options))


def config_to_hf(cfg: ModelConfig, original: dict) -> dict:
    options = read_options(cfg, LatentOptions)
    hf = dict(original)
    model_type = hf.get("model_type") if hf.get("model_type") in MODEL_TYPES else NAME
    hf.update(model_type=model_type, architectures=hf.get("architectures") or [MODEL_TYPES[model_type]],
              vocab_size=cfg.vocab_size, num_hidden_layers=cfg.n_layers, hidden_size=cfg.d_model,
              num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads, intermediate_size=cfg.d_ff,
              max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
              tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu", attention_bias=False,
              q_lora_rank=options.q_lora_rank or None, kv_lora_rank=options.kv_lora_rank,
              qk_nope_head_dim=options.qk_nope_head_dim, qk_rope_head_dim=options.qk_rope_head_dim,
              v_head_dim=options.v_head_dim,
              first_k_dense_replace=max(hf.get("first_k_dense_replace") or 0, cfg.n_layers))  # every layer dense
    if model_type == "deepseek_v3":
        hf["rope_interleave"] = options.rope_interleave  # V2 always interleaves: read back, a V2 file says so
    default_rope_to_hf(hf, cfg, original)
    return hf


FAMILY = Family(NAME, tuple(MODEL_TYPES), TENSOR_PARALLEL, config_from_hf, config_to_hf,
                partial(tensors_from_hf, layer=LAYER, label="DeepSeek"), partial(tensors_to_hf, layer=LAYER),
                block=OwnBlock(**described(block_shape, check)))
