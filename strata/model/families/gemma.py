"""Gemma (Google, 2B and 7B): Llama's layout and names with
- RMSNorm scaling by (1 + weight), the weight kept as stored (0 means scale 1), computed in fp32
  (transformers' GemmaRMSNorm);
- token embeddings multiplied by sqrt(hidden_size), an fp32 number cast to the activations' dtype
  (transformers' GemmaTextScaledWordEmbedding);
- GeGLU: the gate through the tanh GELU (hidden_act gelu_pytorch_tanh; the released configs say
  "gelu", which transformers reads as the tanh one);
- head_dim 256 whatever the width (7B: 3072 wide, 16 heads: queries 4096 wide), multi-query
  attention in 2B, and the head tied to the embedding."""

from __future__ import annotations

from strata.model.config import ModelConfig
from strata.model.families.base import check_choice, refuse_set
from strata.model.families.llama import TENSOR_PARALLEL, llama_style, shape_from_hf, shape_to_hf

NAME = "gemma"
TANH_GELU = ("gelu_pytorch_tanh", "gelu")  # GemmaConfig turns a legacy "gelu" into the tanh one


def config_from_hf(hf: dict, where: str) -> ModelConfig:
    refuse_set(hf, where, "attention_bias", "use_bidirectional_attention")
    check_choice(hf, where, "hidden_act", TANH_GELU, "gelu_pytorch_tanh")
    if hf.get("hidden_activation") is not None:  # what older configs carried next to hidden_act
        check_choice(hf, where, "hidden_activation", TANH_GELU, None)
    return ModelConfig(**shape_from_hf(hf, where, head_dim_default=256, tie_default=True), norm="gemma_rmsnorm",
                       mlp="geglu", scale_embeddings=True, family=NAME)


def config_to_hf(cfg: ModelConfig, original: dict) -> dict:
    hf = shape_to_hf(cfg, original, "gemma", "GemmaForCausalLM")
    return {**hf, "hidden_act": hf.get("hidden_act", "gelu_pytorch_tanh")}


FAMILY = llama_style(NAME, ("gemma",), TENSOR_PARALLEL, config_from_hf, config_to_hf, label="Gemma")
