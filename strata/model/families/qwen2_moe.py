"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B; transformers' model_type "qwen2_moe"): Qwen2's
attention (q/k/v biases unless qkv_bias is false) with every block's MLP a mixture of SwiGLU
experts of moe_intermediate_size, k per token renormalised only when norm_topk_prob (false in the
released models), plus a shared expert of shared_expert_intermediate_size scaled by sigmoid(a
learned gate).

The file's names (transformers 5 writes them though its modules fuse gate and up in memory):
model.layers.N.mlp.gate (the router), mlp.experts.J.gate_proj / up_proj / down_proj (stacked on
the way in, split on the way out: mixtral.py's helpers), mlp.shared_expert.* and
mlp.shared_expert_gate ([1, hidden]).

A config whose decoder_sparse_step or mlp_only_layers leaves some blocks dense (an MLP of
intermediate_size) builds the shared Block layer by layer (mixtral.SPARSE_LAYERS). Sliding windows are read as Qwen2's, but
by Qwen2-MoE's own rule when layer_types is absent (transformers' Qwen2MoeConfig: the even layers
below max_window_layers), so a window is read only when every layer has it, or none."""

from __future__ import annotations

from strata.model.config import ModelConfig
from strata.model.families.base import check_choice
from strata.model.families.llama import shape_from_hf, shape_to_hf
from strata.model.families.mixtral import (
    ATTENTION_LAYER,
    DENSE_MLP_LAYER,
    SPARSE_LAYERS,
    ExpertNames,
    experts_from_hf,
    experts_to_hf,
    moe_style,
    sparse_layers_from_hf,
    sparse_layers_to_hf,
)
from strata.model.families.qwen2 import sliding_window_from_hf, sliding_window_to_hf

NAME = "qwen2_moe"
QWEN2_MOE_EXPERTS = ExpertNames("mlp.experts", {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"})
QWEN2_MOE_LAYER = {**ATTENTION_LAYER, **DENSE_MLP_LAYER, "mlp.gate": "mlp.router", QWEN2_MOE_EXPERTS.path: "mlp.experts",
                   "mlp.shared_expert.gate_proj": "mlp.shared.w_gate", "mlp.shared_expert.up_proj": "mlp.shared.w_up",
                   "mlp.shared_expert.down_proj": "mlp.shared.w_down", "mlp.shared_expert_gate": "mlp.shared_gate"}


def layer_kinds(hf: dict) -> list[str]:
    """Each layer's attention as transformers' Qwen2MoeConfig derives it when layer_types is absent."""
    windowed = bool(hf.get("use_sliding_window"))
    return ["sliding_attention" if windowed and i % 2 == 0 and i < hf.get("max_window_layers", 28)
            else "full_attention" for i in range(hf["num_hidden_layers"])]


def config_from_hf(hf: dict, where: str) -> ModelConfig:
    check_choice(hf, where, "hidden_act", ("silu",), "silu")
    window = sliding_window_from_hf({**hf, "layer_types": hf.get("layer_types") or layer_kinds(hf)}, where)
    return ModelConfig(**shape_from_hf(hf, where), **experts_from_hf(hf, where, "num_experts", (60, 4)),
                       expert_d_ff=hf.get("moe_intermediate_size", 1408),
                       shared_d_ff=hf.get("shared_expert_intermediate_size", 5632), gated_shared_expert=True,
                       norm_topk=bool(hf.get("norm_topk_prob", False)), qkv_bias=bool(hf.get("qkv_bias", True)),
                       sliding_window=window, family=NAME, family_options=sparse_layers_from_hf(hf, where))


def config_to_hf(cfg: ModelConfig, original: dict) -> dict:
    hf = shape_to_hf(cfg, original, "qwen2_moe", "Qwen2MoeForCausalLM")
    hf.update(experts_to_hf(cfg, "num_experts"), hidden_act="silu", moe_intermediate_size=cfg.expert_width,
              shared_expert_intermediate_size=cfg.shared_d_ff, norm_topk_prob=cfg.norm_topk, qkv_bias=cfg.qkv_bias,
              **sparse_layers_to_hf(cfg))
    # layer_types written out: Qwen2-MoE's max_window_layers rule cannot window every layer
    return sliding_window_to_hf(cfg, {**hf, "layer_types": None})


FAMILY = moe_style(NAME, ("qwen2_moe",), config_from_hf, config_to_hf, QWEN2_MOE_LAYER, QWEN2_MOE_EXPERTS,
                   "Qwen2-MoE", block=SPARSE_LAYERS)
