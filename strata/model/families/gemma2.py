"""Gemma 2 (Google 2024: 2B, 9B, 27B): Gemma's (1 + w) RMSNorm, GeGLU, scaled embedding and tied
head, in the sandwich block (strata/model/sandwich_block.py: a norm before and after each
sub-block, four per layer), with
- attention scores scaled by 1/sqrt(query_pre_attn_scalar) (27B: 144 with heads of 128) and
  soft-capped, 50 · tanh(scores / 50) (attn_logit_softcapping);
- the logits soft-capped, 30 · tanh(logits / 30) (final_logit_softcapping: the Transformer caps
  them, before the loss; elementwise, so each vocabulary-parallel rank caps its own columns);
- local layers (a sliding window of 4,096) alternating with global ones, the first local
  (transformers' layer_types, read as a repeating pattern: "LG").

Its options (cfg.family_options, Gemma2Options) are Gemma 2's own keys; 0 stands for a key that is
null (no cap, no window). Its tensors are Llama's, with the two norms after the sub-blocks."""

from __future__ import annotations

from dataclasses import dataclass, replace

from strata.errors import ConfigError
from strata.model.config import ModelConfig
from strata.model.families.base import OwnBlock, check_choice, check_option, in_blocks, read_options, refuse_set
from strata.model.families.gemma import TANH_GELU
from strata.model.families.llama import LAYER, llama_style, shape_from_hf, shape_to_hf
from strata.model.sandwich_block import GLOBAL, LOCAL, SandwichShape, described

NAME = "gemma2"
# Gemma 2's post_attention_layernorm follows the attention (Llama's precedes the MLP)
GEMMA2_LAYER = {**{k: v for k, v in LAYER.items() if not k.endswith("layernorm")}, "input_layernorm": "attn_norm",
                "post_attention_layernorm": "post_attn_norm", "pre_feedforward_layernorm": "mlp_norm",
                "post_feedforward_layernorm": "post_mlp_norm"}
BLOCK_TENSOR_PARALLEL = {"attn_norm": "input_norm", "attn.wq": "column", "attn.wk": "kv_column",
                         "attn.wv": "kv_column", "attn.wo": "row", "post_attn_norm": "output_norm",
                         "mlp_norm": "input_norm", "mlp.w_gate": "column", "mlp.w_up": "column", "mlp.w_down": "row",
                         "post_mlp_norm": "output_norm"}
TENSOR_PARALLEL = {"embed": "vocabulary", "head": "vocabulary", "final_norm": "input_norm",
                   **in_blocks(BLOCK_TENSOR_PARALLEL)}
LAYER_TYPES = {"sliding_attention": LOCAL, "full_attention": GLOBAL}


@dataclass(frozen=True)
class Gemma2Options:
    attention_bias: bool  # biases on q, k, v and o
    query_pre_attn_scalar: float  # scores are q·k / sqrt(it)
    attn_logit_softcapping: float  # 0: none
    final_logit_softcapping: float  # 0: none
    sliding_window: int  # the local layers' window; 0: none
    layer_types: str  # "L" (sliding_attention) or "G" (full_attention) per layer, repeating


def block_shape(cfg: ModelConfig) -> SandwichShape:
    o = read_options(cfg, Gemma2Options)
    return SandwichShape(pre_norms=True, qk_norm="none", attention_bias=o.attention_bias,
                         query_scalar=o.query_pre_attn_scalar, attn_softcap=o.attn_logit_softcapping,
                         window=o.sliding_window, layer_types=o.layer_types, local_rope_theta=0.0)


def check_options(options) -> None:
    """The options Gemma 2 and Gemma 3 share."""
    check_option("attention_bias", options.attention_bias, bool)
    check_option("query_pre_attn_scalar", options.query_pre_attn_scalar, float, lambda s: s > 0)
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        check_option(name, getattr(options, name), float, lambda c: 0 <= c < float("inf"))
    check_option("sliding_window", options.sliding_window, int, lambda w: w >= 0)
    check_option("layer_types", options.layer_types, str, lambda t: t and not set(t) - {LOCAL, GLOBAL})


def check(cfg: ModelConfig) -> None:
    check_options(read_options(cfg, Gemma2Options))


def final_logit_softcap(cfg: ModelConfig) -> float:
    return read_options(cfg, Gemma2Options).final_logit_softcapping


# --- config.json ----------------------------------------------------------------------------------
def check_gemma_keys(hf: dict, where: str) -> None:
    """What Gemma 2 and 3 refuse or check alike."""
    refuse_set(hf, where, "use_bidirectional_attention")
    check_choice(hf, where, "hidden_activation", TANH_GELU, "gelu_pytorch_tanh")
    if hf.get("hidden_act") is not None:  # what older configs carried beside hidden_activation
        check_choice(hf, where, "hidden_act", TANH_GELU, None)


def layer_pattern(hf: dict, where: str, period: int) -> str:
    """config.json's layer_types as the shortest repeating pattern of "L" and "G" (transformers'
    default when absent: every `period`-th layer global, the others sliding)."""
    n = hf["num_hidden_layers"]
    kinds = hf.get("layer_types") or ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                                      for i in range(n)]
    if not isinstance(kinds, list) or len(kinds) != n or any(kind not in LAYER_TYPES for kind in kinds):
        raise ConfigError(f"{where}: config.json: layer_types={kinds!r} is not supported (one of "
                          f"{', '.join(LAYER_TYPES)} per layer)")
    letters = "".join(LAYER_TYPES[kind] for kind in kinds)
    return next(letters[:p] for p in range(1, n + 1) if all(letters[i] == letters[i % p] for i in range(n)))


def layer_types_to_hf(pattern: str, n_layers: int) -> list[str]:
    names = {letter: kind for kind, letter in LAYER_TYPES.items()}
    return [names[pattern[i % len(pattern)]] for i in range(n_layers)]


def gemma_options_from_hf(hf: dict, where: str, period: int, caps: tuple) -> dict:
    """The options Gemma 2 and 3 share, by their config.json keys (caps: the two caps' defaults)."""
    def number(key: str, default) -> float:
        value = hf.get(key, default)
        return 0.0 if value is None else value
    return dict(attention_bias=bool(hf.get("attention_bias", False)),
                query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
                attn_logit_softcapping=number("attn_logit_softcapping", caps[0]),
                final_logit_softcapping=number("final_logit_softcapping", caps[1]),
                sliding_window=int(number("sliding_window", 4096)), layer_types=layer_pattern(hf, where, period))


def gemma_options_to_hf(options, n_layers: int) -> dict:
    return dict(attention_bias=options.attention_bias, query_pre_attn_scalar=options.query_pre_attn_scalar,
                attn_logit_softcapping=options.attn_logit_softcapping or None,
                final_logit_softcapping=options.final_logit_softcapping or None,
                sliding_window=options.sliding_window or None,
                layer_types=layer_types_to_hf(options.layer_types, n_layers))


def config_from_hf(hf: dict, where: str) -> ModelConfig:
    check_gemma_keys(hf, where)
    options = gemma_options_from_hf(hf, where, period=2, caps=(50.0, 30.0))  # Gemma2Config's defaults
    return ModelConfig(**shape_from_hf(hf, where, head_dim_default=256, tie_default=True), norm="gemma_rmsnorm",
                       mlp="geglu", scale_embeddings=True, family=NAME, family_options=options)


def config_to_hf(cfg: ModelConfig, original: dict) -> dict:
    hf = shape_to_hf(cfg, original, "gemma2", "Gemma2ForCausalLM")
    options = read_options(cfg, Gemma2Options)
    return {**hf, "hidden_activation": hf.get("hidden_activation", "gelu_pytorch_tanh"),
            **gemma_options_to_hf(options, cfg.n_layers)}


FAMILY = replace(llama_style(NAME, ("gemma2",), TENSOR_PARALLEL, config_from_hf, config_to_hf, layer=GEMMA2_LAYER,
                             label="Gemma 2"),
                 block=OwnBlock(**described(block_shape, check), final_logit_softcap=final_logit_softcap))
