"""Qwen3 (Alibaba, dense models): Llama's layout and names, no biases, an explicit head_dim (128,
wider than hidden / heads in the small models) and an RMSNorm over each head's q and k before
RoPE (transformers' Qwen3Attention: q_norm, k_norm of size head_dim, shared by the heads).
Sliding windows as Qwen2's (off in the released models)."""

from __future__ import annotations

from strata.model.config import ModelConfig
from strata.model.families.base import check_choice, in_blocks, refuse_set
from strata.model.families.llama import LAYER, TENSOR_PARALLEL, llama_style, shape_from_hf, shape_to_hf
from strata.model.families.qwen2 import sliding_window_from_hf, sliding_window_to_hf

NAME = "qwen3"
QWEN3_LAYER = {**LAYER, "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm"}
# the q/k norms act on every head alike: whole on every rank (each rank's heads add to their gradient)
QWEN3_TENSOR_PARALLEL = {**TENSOR_PARALLEL, **in_blocks({"attn.q_norm": "head_norm", "attn.k_norm": "head_norm"})}


def config_from_hf(hf: dict, where: str) -> ModelConfig:
    refuse_set(hf, where, "attention_bias")
    check_choice(hf, where, "hidden_act", ("silu",), "silu")
    return ModelConfig(**shape_from_hf(hf, where, head_dim_default=128), qk_norm=True,
                       sliding_window=sliding_window_from_hf(hf, where), family=NAME)


def config_to_hf(cfg: ModelConfig, original: dict) -> dict:
    hf = shape_to_hf(cfg, original, "qwen3", "Qwen3ForCausalLM")
    return sliding_window_to_hf(cfg, {**hf, "hidden_act": "silu", "attention_bias": False})


FAMILY = llama_style(NAME, ("qwen3",), QWEN3_TENSOR_PARALLEL, config_from_hf, config_to_hf, QWEN3_LAYER, "Qwen3")
