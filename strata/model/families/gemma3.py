"""Gemma 3's text model (Google 2025: Gemma3ForCausalLM, model_type gemma3_text; 1B, and the language
model of 4B to 27B): Gemma 2's sandwich block (families/gemma2.py) with
- an RMSNorm over each head's q and k before RoPE, Gemma's (1 + w) one (transformers'
  Gemma3RMSNorm);
- five local layers for every global one (layer_types; the older sliding_window_pattern 6), a
  window of 512 (1B) or 1,024;
- a RoPE base of their own for the local layers (10,000; the global ones 1,000,000), and for the
  global ones, in 4B and up, linear scaling (rope_type "linear", factor 8: positions / 8);
- no soft caps by default (either one read when the config.json sets it).

The two RoPE bases are written back in the form they were read: transformers 5's rope_parameters
per layer type, or the released files' rope_theta, rope_local_base_freq and rope_scaling."""

from __future__ import annotations

from dataclasses import dataclass, replace

from strata.errors import ConfigError
from strata.model.config import ModelConfig
from strata.model.families.base import OwnBlock, check_option, in_blocks, read_options
from strata.model.families.gemma2 import (
    BLOCK_TENSOR_PARALLEL,
    GEMMA2_LAYER,
    check_gemma_keys,
    check_options,
    gemma_options_from_hf,
    gemma_options_to_hf,
)
from strata.model.families.llama import llama_style, shape_from_hf, shape_to_hf
from strata.model.sandwich_block import SandwichShape, described

NAME = "gemma3"
GEMMA3_LAYER = {**GEMMA2_LAYER, "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm"}
TENSOR_PARALLEL = {"embed": "vocabulary", "head": "vocabulary", "final_norm": "input_norm",
                   **in_blocks({**BLOCK_TENSOR_PARALLEL, "attn.q_norm": "head_norm", "attn.k_norm": "head_norm"})}
DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # Gemma3TextConfig's


@dataclass(frozen=True)
class Gemma3Options:
    attention_bias: bool
    query_pre_attn_scalar: float
    attn_logit_softcapping: float  # 0: none (Gemma 3's default)
    final_logit_softcapping: float  # 0: none (Gemma 3's default)
    sliding_window: int
    layer_types: str  # "L" or "G" per layer, repeating ("LLLLLG")
    rope_local_base_freq: float  # the local layers' RoPE base
    rope_scaling_factor: float  # the global layers' linear RoPE scaling (1: none)


def block_shape(cfg: ModelConfig) -> SandwichShape:
    o = read_options(cfg, Gemma3Options)
    return SandwichShape(pre_norms=True, qk_norm="head", attention_bias=o.attention_bias,
                         query_scalar=o.query_pre_attn_scalar, attn_softcap=o.attn_logit_softcapping,
                         window=o.sliding_window, layer_types=o.layer_types, local_rope_theta=o.rope_local_base_freq,
                         rope_factor=o.rope_scaling_factor)


def check(cfg: ModelConfig) -> None:
    options = read_options(cfg, Gemma3Options)
    check_options(options)
    for name in ("rope_local_base_freq", "rope_scaling_factor"):
        check_option(name, getattr(options, name), float, lambda x: 0 < x < float("inf"))


def final_logit_softcap(cfg: ModelConfig) -> float:
    return read_options(cfg, Gemma3Options).final_logit_softcapping


# --- config.json ----------------------------------------------------------------------------------
def rope_from_hf(hf: dict, where: str) -> dict:
    """Each layer type's RoPE: base and linear factor of the global layers, base of the local ones."""
    nested = hf.get("rope_parameters")
    if isinstance(nested, dict) and set(nested) <= set(DEFAULT_THETA):  # transformers 5's, per layer type
        full, sliding = nested.get("full_attention") or {}, nested.get("sliding_attention") or {}
    else:  # the released files': rope_theta, rope_local_base_freq, rope_scaling (the global layers')
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", DEFAULT_THETA["full_attention"])}
        sliding = {"rope_theta": hf.get("rope_local_base_freq", DEFAULT_THETA["sliding_attention"])}
    for kind, rope, valid in (("full_attention", full, ("default", "linear")), ("sliding_attention", sliding,
                                                                               ("default",))):
        if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) not in valid:
            raise ConfigError(f"{where}: config.json: the {kind} layers' rope_type {rope!r} is not supported; "
                              f"valid: {', '.join(valid)}")
    linear = full.get("rope_type", full.get("type")) == "linear"
    return dict(rope_theta=full.get("rope_theta", DEFAULT_THETA["full_attention"]),
                rope_local_base_freq=sliding.get("rope_theta", DEFAULT_THETA["sliding_attention"]),
                rope_scaling_factor=full["factor"] if linear else 1.0)


def config_from_hf(hf: dict, where: str) -> ModelConfig:
    check_gemma_keys(hf, where)
    rope = rope_from_hf(hf, where)
    period = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
    options = {**gemma_options_from_hf(hf, where, period, caps=(None, None)),
               "rope_local_base_freq": rope["rope_local_base_freq"], "rope_scaling_factor": rope["rope_scaling_factor"]}
    # the global layers' base stands in Llama's place: the shared reader takes it from there
    shape = shape_from_hf({**hf, "rope_parameters": None, "rope_scaling": None, "rope_theta": rope["rope_theta"]},
                          where, head_dim_default=256, tie_default=True)
    return ModelConfig(**shape, norm="gemma_rmsnorm", mlp="geglu", scale_embeddings=True, family=NAME,
                       family_options=options)


def config_to_hf(cfg: ModelConfig, original: dict) -> dict:
    options = read_options(cfg, Gemma3Options)
    hf = shape_to_hf(cfg, {k: v for k, v in original.items() if k != "rope_parameters"}, "gemma3_text",
                     "Gemma3ForCausalLM")
    full = {"rope_type": "linear", "factor": options.rope_scaling_factor} if options.rope_scaling_factor != 1 else \
        {"rope_type": "default"}
    if "rope_parameters" in original or not original:  # transformers 5's form
        hf["rope_parameters"] = {"full_attention": {**full, "rope_theta": cfg.rope_theta},
                                 "sliding_attention": {"rope_type": "default",
                                                       "rope_theta": options.rope_local_base_freq}}
        hf.pop("rope_theta", None)
    else:  # the released files' form
        hf.update(rope_theta=cfg.rope_theta, rope_local_base_freq=options.rope_local_base_freq,
                  rope_scaling=full if options.rope_scaling_factor != 1 else None)
    return {**hf, "hidden_activation": hf.get("hidden_activation", "gelu_pytorch_tanh"),
            **gemma_options_to_hf(options, cfg.n_layers)}


FAMILY = replace(llama_style(NAME, ("gemma3_text",), TENSOR_PARALLEL, config_from_hf, config_to_hf,
                             layer=GEMMA3_LAYER, label="Gemma 3"),
                 block=OwnBlock(**described(block_shape, check), final_logit_softcap=final_logit_softcap))
