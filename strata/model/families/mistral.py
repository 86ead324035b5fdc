"""Mistral (Mistral AI; 7B v0.1 onwards): Llama's layout and names with sliding-window attention,
each token attending to the last `sliding_window` positions, itself included (4,096 in v0.1; null,
i.e. off, from v0.2), and an optional explicit head_dim (Mistral NeMo: 5120 wide, 32 heads of 128).

The window splits nothing under tensor parallelism: it masks keys by position, the same on every
rank, whatever heads the rank holds."""

from __future__ import annotations

from strata.model.config import ModelConfig
from strata.model.families.base import check_choice, refuse_set
from strata.model.families.llama import TENSOR_PARALLEL, llama_style, shape_from_hf, shape_to_hf

NAME = "mistral"
DEFAULT_WINDOW = 4096  # transformers' MistralConfig, when config.json has no sliding_window key


def config_from_hf(hf: dict, where: str) -> ModelConfig:
    refuse_set(hf, where, "layer_types")  # alternating windows: transformers' Ministral
    check_choice(hf, where, "hidden_act", ("silu",), "silu")
    return ModelConfig(**shape_from_hf(hf, where), sliding_window=hf.get("sliding_window", DEFAULT_WINDOW),
                       family=NAME)


def config_to_hf(cfg: ModelConfig, original: dict) -> dict:
    hf = shape_to_hf(cfg, original, "mistral", "MistralForCausalLM")
    return {**hf, "hidden_act": "silu", "sliding_window": cfg.sliding_window}


FAMILY = llama_style(NAME, ("mistral",), TENSOR_PARALLEL, config_from_hf, config_to_hf, label="Mistral")
