"""Qwen3-MoE (Alibaba, Qwen3-30B-A3B and -235B-A22B; transformers' model_type "qwen3_moe"): Qwen3's
attention (no biases, head_dim given, an RMSNorm over each head's q and k before RoPE) and, in
every block, a mixture of SwiGLU experts of moe_intermediate_size: a softmax router over
num_experts, the top num_experts_per_tok per token, their probabilities renormalised when
norm_topk_prob (true in the released models). Unlike Qwen2-MoE, no shared expert.

The file's names are Qwen2-MoE's: model.layers.N.mlp.gate (the router) and
mlp.experts.J.gate_proj / up_proj / down_proj (stacked on the way in, split on the way out:
mixtral.py's helpers), with Qwen3's self_attn.q_norm and k_norm.

The number of experts: released files (transformers 4) write num_experts, transformers 5 writes
num_local_experts (its Qwen3MoeConfig maps one onto the other); both are read, and the one the
original file used is written back. A config whose decoder_sparse_step or mlp_only_layers leaves
some blocks dense (each with an MLP of intermediate_size, which otherwise computes nothing) builds
the shared Block layer by layer (mixtral.SPARSE_LAYERS). A sliding window, when use_sliding_window, is every layer's (transformers 5's
Qwen3MoeAttention: no max_window_layers)."""

from __future__ import annotations

from strata.model.config import ModelConfig
from strata.model.families.base import check_choice, in_blocks, refuse_set
from strata.model.families.llama import shape_from_hf, shape_to_hf
from strata.model.families.mixtral import (
    MOE_TENSOR_PARALLEL,
    SPARSE_LAYERS,
    experts_from_hf,
    experts_to_hf,
    moe_style,
    sparse_layers_from_hf,
    sparse_layers_to_hf,
)
from strata.model.families.qwen2_moe import QWEN2_MOE_EXPERTS
from strata.model.families.qwen3 import QWEN3_LAYER

NAME = "qwen3_moe"
# transformers' Qwen3MoeConfig defaults, for keys a config.json leaves out
DEFAULT_EXPERTS, DEFAULT_K, DEFAULT_EXPERT_WIDTH, DEFAULT_INTERMEDIATE = 128, 8, 768, 6144
# Qwen3's attention names (q/k norms included) and Qwen2-MoE's mixture, without its shared expert
QWEN3_MOE_LAYER = {**QWEN3_LAYER,  # (its dense MLP's names: a sparse model's dense layers)
                   "mlp.gate": "mlp.router", QWEN2_MOE_EXPERTS.path: "mlp.experts"}
# the q/k norms act on every head alike: whole on every rank (each rank's heads add to their gradient)
QWEN3_MOE_TENSOR_PARALLEL = {**MOE_TENSOR_PARALLEL,
                             **in_blocks({"attn.q_norm": "head_norm", "attn.k_norm": "head_norm"})}


def experts_key(hf: dict) -> str:
    """The key a config.json gives the number of experts under (num_experts when it gives none)."""
    if hf.get("num_experts") is None and "num_local_experts" in hf:
        return "num_local_experts"
    return "num_experts"


def config_from_hf(hf: dict, where: str) -> ModelConfig:
    refuse_set(hf, where, "attention_bias")
    check_choice(hf, where, "hidden_act", ("silu",), "silu")
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    return ModelConfig(**shape_from_hf({"intermediate_size": DEFAULT_INTERMEDIATE, **hf}, where), qk_norm=True,
                       **experts_from_hf(hf, where, experts_key(hf), (DEFAULT_EXPERTS, DEFAULT_K)),
                       expert_d_ff=hf.get("moe_intermediate_size", DEFAULT_EXPERT_WIDTH),
                       norm_topk=bool(hf.get("norm_topk_prob", False)), sliding_window=window, family=NAME,
                       family_options=sparse_layers_from_hf(hf, where))


def config_to_hf(cfg: ModelConfig, original: dict) -> dict:
    hf = shape_to_hf(cfg, original, "qwen3_moe", "Qwen3MoeForCausalLM")
    hf.update(experts_to_hf(cfg, experts_key(original)), hidden_act="silu", attention_bias=False,
              moe_intermediate_size=cfg.expert_width, norm_topk_prob=cfg.norm_topk,
              use_sliding_window=cfg.sliding_window is not None, **sparse_layers_to_hf(cfg))
    if cfg.sliding_window is not None:
        hf["sliding_window"] = cfg.sliding_window
    return hf


FAMILY = moe_style(NAME, ("qwen3_moe",), config_from_hf, config_to_hf, QWEN3_MOE_LAYER, QWEN2_MOE_EXPERTS,
                   "Qwen3-MoE", QWEN3_MOE_TENSOR_PARALLEL, SPARSE_LAYERS)
