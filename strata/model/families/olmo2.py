"""OLMo 2 (OLMo et al. 2024, "2 OLMo 2 Furious": 1B, 7B, 13B, 32B): Llama's RMSNorm, RoPE, SwiGLU and
untied head, in the sandwich block without its first norms (strata/model/sandwich_block.py: each
sub-block reads the residual stream as it is, and its output is normed before it joins it,
x + norm(attn(x))), and an RMSNorm over the whole q and the whole k projections before RoPE (not
per head, as Qwen3's and Gemma 3's: its mean runs over every head's features).

Under tensor parallelism each rank holds a slice of the heads, so the q and k norms sum their
squares over the group (placements projection_norm and kv_projection_norm; with fewer KV heads
than ranks K is computed whole for its norm, and each rank keeps its own heads after it).
Its one option, attention_bias, is OLMo 2's own key (cfg.family_options, Olmo2Options)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from strata.model.config import ModelConfig
from strata.model.families.base import OwnBlock, check_choice, check_option, in_blocks, read_options
from strata.model.families.llama import LAYER, llama_style, shape_from_hf, shape_to_hf
from strata.model.sandwich_block import GLOBAL, SandwichShape, described

NAME = "olmo2"
# OLMo 2's post_attention_layernorm follows the attention (Llama's precedes the MLP)
OLMO2_LAYER = {**{k: v for k, v in LAYER.items() if not k.endswith("layernorm")},
               "post_attention_layernorm": "post_attn_norm", "post_feedforward_layernorm": "post_mlp_norm",
               "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm"}
# attn_input, mlp_input: identities in the place of the missing first norms, where the input
# conversion of the column-parallel layers after them hangs
TENSOR_PARALLEL = {"embed": "vocabulary", "head": "vocabulary", "final_norm": "input_norm",
                   **in_blocks({"attn_input": "input_norm", "attn.wq": "column", "attn.wk": "normed_kv_column",
                                "attn.wv": "kv_column", "attn.wo": "row", "attn.q_norm": "projection_norm",
                                "attn.k_norm": "kv_projection_norm", "post_attn_norm": "output_norm",
                                "mlp_input": "input_norm", "mlp.w_gate": "column", "mlp.w_up": "column",
                                "mlp.w_down": "row", "post_mlp_norm": "output_norm"})}


@dataclass(frozen=True)
class Olmo2Options:
    attention_bias: bool  # biases on q, k, v and o


def block_shape(cfg: ModelConfig) -> SandwichShape:
    return SandwichShape(pre_norms=False, qk_norm="projection",
                         attention_bias=read_options(cfg, Olmo2Options).attention_bias,
                         query_scalar=cfg.head_dim, attn_softcap=0.0, window=0, layer_types=GLOBAL,
                         local_rope_theta=0.0)


def check(cfg: ModelConfig) -> None:
    check_option("attention_bias", read_options(cfg, Olmo2Options).attention_bias, bool)


# --- config.json ----------------------------------------------------------------------------------
def config_from_hf(hf: dict, where: str) -> ModelConfig:
    check_choice(hf, where, "hidden_act", ("silu",), "silu")
    return ModelConfig(**shape_from_hf(hf, where), family=NAME,
                       family_options={"attention_bias": bool(hf.get("attention_bias", False))})


def config_to_hf(cfg: ModelConfig, original: dict) -> dict:
    hf = shape_to_hf(cfg, original, "olmo2", "Olmo2ForCausalLM")
    return {**hf, "hidden_act": "silu", "attention_bias": read_options(cfg, Olmo2Options).attention_bias}


FAMILY = replace(llama_style(NAME, ("olmo2",), TENSOR_PARALLEL, config_from_hf, config_to_hf, layer=OLMO2_LAYER,
                             label="OLMo 2"),
                 block=OwnBlock(**described(block_shape, check)))
