"""Qwen2 and Qwen2.5 (Alibaba): Llama's layout and names with biases on q, k and v only (not on
the output projection nor the MLP: transformers' Qwen2Attention), RoPE theta 1,000,000, tied
embeddings in the small models.

Sliding-window attention is off in every released Qwen2/2.5 (use_sliding_window false); when on,
transformers applies it to the layers from max_window_layers up. strata computes one window for
every layer, so only a config whose layers are all windowed, or none, is read."""

from __future__ import annotations

from strata.errors import ConfigError
from strata.model.config import ModelConfig
from strata.model.families.base import check_choice
from strata.model.families.llama import TENSOR_PARALLEL, llama_style, shape_from_hf, shape_to_hf

NAME = "qwen2"


def sliding_window_from_hf(hf: dict, where: str) -> int | None:
    """The window of a Qwen config.json (transformers' Qwen2Config: layer i is windowed when
    use_sliding_window and i >= max_window_layers, or as layer_types says), when it is every
    layer's; None when no layer has one."""
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return None
    layers = hf["num_hidden_layers"]
    kinds = hf.get("layer_types") or ["sliding_attention" if i >= hf.get("max_window_layers", 28)
                                      else "full_attention" for i in range(layers)]
    if set(kinds) == {"full_attention"}:
        return None
    if set(kinds) == {"sliding_attention"}:
        return hf["sliding_window"]
    raise ConfigError(f"{where}: config.json: use_sliding_window with max_window_layers="
                      f"{hf.get('max_window_layers', 28)} windows some layers only; strata windows all or none")


def sliding_window_to_hf(cfg: ModelConfig, hf: dict) -> dict:
    """The window as Qwen's config.json keys: on every layer, or off."""
    if cfg.sliding_window is None:
        hf["use_sliding_window"] = False
        if "layer_types" in hf:
            hf["layer_types"] = ["full_attention"] * cfg.n_layers
        return hf
    hf.update(use_sliding_window=True, sliding_window=cfg.sliding_window, max_window_layers=0)
    if "layer_types" in hf:
        hf["layer_types"] = ["sliding_attention"] * cfg.n_layers
    return hf


def config_from_hf(hf: dict, where: str) -> ModelConfig:
    check_choice(hf, where, "hidden_act", ("silu",), "silu")
    return ModelConfig(**shape_from_hf(hf, where), qkv_bias=True, sliding_window=sliding_window_from_hf(hf, where),
                       family=NAME)


def config_to_hf(cfg: ModelConfig, original: dict) -> dict:
    hf = shape_to_hf(cfg, original, "qwen2", "Qwen2ForCausalLM")
    return sliding_window_to_hf(cfg, {**hf, "hidden_act": "silu"})


FAMILY = llama_style(NAME, ("qwen2",), TENSOR_PARALLEL, config_from_hf, config_to_hf, label="Qwen2")
