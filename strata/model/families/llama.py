"""Llama (Meta: LLaMA, Llama 2, Llama 3, 3.1+): RMSNorm, RoPE, SwiGLU, grouped-query attention, an
untied head unless tie_word_embeddings, and Llama 3.1's RoPE scaling (rope_type "llama3").

strata's layers were written in Hugging Face's conventions: RoPE in the "rotate half" layout, so
q and k convert without permuting rows, and every tensor only changes its name. The Llama-style
families (Qwen2, Qwen3, Mistral, Gemma, Phi-3) store their tensors under these same names; they read and
write through this file's functions with their own options and extra names."""

from __future__ import annotations

from functools import partial

from strata.errors import ConfigError
from strata.model.config import ModelConfig
from strata.model.families.base import (
    Family,
    check_choice,
    in_blocks,
    name_from_hf,
    names_to_hf,
    refuse_set,
    tied_head_to_hf,
)

NAME = "llama"
# a Hugging Face module inside model.layers.N -> strata's inside blocks.N
LAYER = {"self_attn.q_proj": "attn.wq", "self_attn.k_proj": "attn.wk", "self_attn.v_proj": "attn.wv",
         "self_attn.o_proj": "attn.wo", "mlp.gate_proj": "mlp.w_gate", "mlp.up_proj": "mlp.w_up",
         "mlp.down_proj": "mlp.w_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}
TOP = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "final_norm.weight",
       "lm_head.weight": "head.weight"}
BLOCKS = "model.layers."  # block N's tensors are under model.layers.N
# Megatron's split (Shoeybi et al. 2019): q, k, v and the MLP's first matrices by output features,
# the output projections by input features; the norms whole on every rank.
TENSOR_PARALLEL = {"embed": "vocabulary", "head": "vocabulary", "final_norm": "input_norm",
                   **in_blocks({"attn_norm": "input_norm", "attn.wq": "column", "attn.wk": "kv_column",
                                "attn.wv": "kv_column", "attn.wo": "row", "mlp_norm": "input_norm",
                                "mlp.w_gate": "column", "mlp.w_up": "column", "mlp.w_down": "row"})}
_DERIVED = ".rotary_emb.inv_freq"  # a buffer some old conversions saved: rebuilt, never read


# --- config.json ----------------------------------------------------------------------------------
def shape_from_hf(hf: dict, where: str, head_dim_default: int | None = None, tie_default: bool = False) -> dict:
    """The ModelConfig fields every Llama-style config.json gives (defaults as transformers' config
    classes have them when a key is absent)."""
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or head_dim_default
    return dict(vocab_size=hf["vocab_size"], n_layers=hf["num_hidden_layers"], d_model=hidden, n_heads=heads,
                n_kv_heads=hf.get("num_key_value_heads") or heads, d_ff=hf["intermediate_size"],
                max_seq_len=hf["max_position_embeddings"], norm_eps=hf.get("rms_norm_eps", 1e-6),
                tie_embeddings=bool(hf.get("tie_word_embeddings", tie_default)),
                d_head=head_dim if head_dim and head_dim * heads != hidden else None, **rope_from_hf(hf, where))


def rope_from_hf(hf: dict, where: str) -> dict:
    """RoPE's fields: transformers 5 writes `rope_parameters` (theta inside), earlier versions
    `rope_scaling` and `rope_theta`. Only the default RoPE and Llama 3.1's scaling are computed."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: config.json: rope_parameters / rope_scaling must be an object, not {rope!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))  # older files: top level
    if partial != 1.0:
        raise ConfigError(f"{where}: config.json: partial_rotary_factor={partial!r} "
                          f"is not supported (RoPE over the whole head)")
    fields = dict(rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "default":
        return fields
    if kind != "llama3":
        raise ConfigError(f"{where}: config.json: rope_type {kind!r} is not supported; valid: default, llama3")
    # transformers' _compute_llama3_parameters; the original context falls back to the model's
    return {**fields, "rope_type": "llama3", "rope_factor": rope["factor"],
            "rope_low_freq_factor": rope["low_freq_factor"], "rope_high_freq_factor": rope["high_freq_factor"],
            "rope_original_max_seq_len": rope.get("original_max_position_embeddings",
                                                  hf["max_position_embeddings"])}


def config_from_hf(hf: dict, where: str) -> ModelConfig:
    refuse_set(hf, where, "attention_bias", "mlp_bias")
    check_choice(hf, where, "hidden_act", ("silu",), "silu")
    return ModelConfig(**shape_from_hf(hf, where), family=NAME)


def shape_to_hf(cfg: ModelConfig, original: dict, model_type: str, architecture: str) -> dict:
    """The original config.json with the Llama-style shape fields set from the model."""
    hf = dict(original)
    hf.update(model_type=model_type, architectures=hf.get("architectures") or [architecture],
              vocab_size=cfg.vocab_size, num_hidden_layers=cfg.n_layers, hidden_size=cfg.d_model,
              num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads, intermediate_size=cfg.d_ff,
              max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, head_dim=cfg.head_dim,
              tie_word_embeddings=cfg.tie_embeddings)
    rope = {"rope_type": cfg.rope_type}
    if cfg.rope_type == "llama3":
        rope.update(factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_seq_len)
    if "rope_parameters" in hf or not original:  # transformers 5's form
        hf["rope_parameters"] = {**(hf.get("rope_parameters") or {}), **rope, "rope_theta": cfg.rope_theta}
    else:  # the form the original was written in
        hf["rope_theta"] = cfg.rope_theta
        if cfg.rope_type != "default" or hf.get("rope_scaling"):
            hf["rope_scaling"] = {**(hf.get("rope_scaling") or {}), **rope}
    return hf


def config_to_hf(cfg: ModelConfig, original: dict) -> dict:
    return {**shape_to_hf(cfg, original, "llama", "LlamaForCausalLM"), "hidden_act": "silu"}


# --- tensors --------------------------------------------------------------------------------------
def tensors_from_hf(hf_tensors: dict, cfg: ModelConfig, where: str, layer: dict = LAYER,
                    label: str = "LLaMA") -> dict:
    out = {}
    for key, value in hf_tensors.items():
        if not key.endswith(_DERIVED):
            out[_name_from_hf(key, layer, where, label)] = value
    if cfg.tie_embeddings:  # a file may store the tied head anyway
        out.pop("head.weight", None)
    return out


def _name_from_hf(key: str, layer: dict, where: str, label: str) -> str:
    name = name_from_hf(key, layer, TOP, BLOCKS)
    if name is None:
        raise ConfigError(f"{where}: unexpected tensor {key!r} for a {label} model")
    return name


def tensors_to_hf(tensors: dict, cfg: ModelConfig, keys: list | None, layer: dict = LAYER) -> dict:
    out = names_to_hf(tensors, layer, TOP, BLOCKS)
    tied_head_to_hf(out, tensors, cfg, keys, "lm_head.weight")
    return out


def llama_style(name: str, model_types: tuple[str, ...], tensor_parallel: dict, config_from_hf, config_to_hf,
                layer: dict = LAYER, label: str = "LLaMA") -> Family:
    """A family stored under Llama's tensor names (with `layer`'s extra ones)."""
    return Family(name, model_types, tensor_parallel, config_from_hf, config_to_hf,
                  partial(tensors_from_hf, layer=layer, label=label), partial(tensors_to_hf, layer=layer))


FAMILY = llama_style(NAME, ("llama",), TENSOR_PARALLEL, config_from_hf, config_to_hf)
