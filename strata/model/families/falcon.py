"""Falcon (TII 2023: Falcon-7B, -40B, -180B; Almazrouei et al. 2023): GPT-NeoX's parallel block
(strata/model/parallel_block.py) with rotary positions over the whole head, the exact GELU, no
biases (`bias`: on every linear layer of the block or on none), LayerNorms with biases and a head
tied to the embedding unless tie_word_embeddings says otherwise. Three layouts of one block:

    Falcon-7B (multi_query): x + attn(ln(x)) + mlp(ln(x)), one K/V head for all the query heads
    Falcon-40B/180B (new_decoder_architecture): x + attn(ln_attn(x)) + mlp(ln_mlp(x)), num_kv_heads
    Falcon-RW's and the first releases' (parallel_attn false): x + attn(ln_1(x)), then + mlp(ln_2(x))

Its fused query_key_value is laid out per KV group, output rows (kv_heads, heads/kv_heads + 2,
head_dim): a group's query heads, then its key, then its value (transformers' FalconAttention views
it so under new_decoder_architecture). Multi-query's [q, k, v] is that layout with one group, the
original multi-head per-head (q, k, v) layout that with a group per head: one rule reads and writes
all three, bit for bit, into strata's wq, wk and wv (split_per_group, join_per_group; StarCoder's
c_attn too). Its options (parallel_attn, the number of norms, bias, activation) are Falcon's own
(cfg.family_options, FalconOptions); the KV heads are the shared n_kv_heads. ALiBi (Falcon-RW) is
refused: the parallel block computes rotary positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.errors import ConfigError
from strata.model.config import ModelConfig
from strata.model.families.base import (
    Family,
    OwnBlock,
    check_choice,
    check_option,
    default_rope_theta_from_hf,
    default_rope_to_hf,
    head_to_hf,
    name_from_hf,
    names_to_hf,
    read_options,
    refuse_set,
)
from strata.model.families.gpt2 import BLOCK_TENSOR_PARALLEL, BLOCKS, strip_prefix, written_prefix
from strata.model.families.gpt_neox import GELU
from strata.model.parallel_block import ParallelShape, described

NAME = "falcon"
# the block's modules but the norms (whose names follow the layout) and the fused query_key_value
LAYER = {"self_attention.dense": "attn.wo", "mlp.dense_h_to_4h": "mlp.w_in", "mlp.dense_4h_to_h": "mlp.w_out"}
# each layout's norms: two in parallel (new_decoder_architecture), one for both, or one before each
NORMS_READ = {"ln_attn": "attn_norm", "ln_mlp": "mlp_norm", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "mlp_norm"}
FUSED = "self_attention.query_key_value"
TOP = {"word_embeddings.weight": "embed.weight", "ln_f.weight": "final_norm.weight", "ln_f.bias": "final_norm.bias"}
HEAD = "lm_head.weight"  # outside the base model's "transformer." prefix
TENSOR_PARALLEL = {"embed": "vocabulary", "head": "vocabulary", "final_norm": "input_norm", **BLOCK_TENSOR_PARALLEL}
# FalconConfig's defaults: the released config.json files leave most keys out (Falcon-7B's has no
# max_position_embeddings, ffn_hidden_size nor num_kv_heads)
DEFAULT_POSITIONS = 2048


@dataclass(frozen=True)
class FalconOptions:
    parallel_attn: bool  # attention and MLP from one residual (every released Falcon); else one after the other
    norms: int  # 2: the MLP reads a norm of its own (ln_mlp; a sequential block's second); 1: the attention's
    bias: bool  # biases on query_key_value, dense and the MLP's two matrices
    activation: str  # one of gpt_neox.GELU: the exact GELU ("gelu") or its tanh approximation


def block_shape(cfg: ModelConfig) -> ParallelShape:
    options = read_options(cfg, FalconOptions)
    return ParallelShape(cfg.head_dim, interleaved=False, parallel=options.parallel_attn, one_norm=options.norms == 1,
                         attention_bias=options.bias, gelu=GELU.get(options.activation, options.activation),
                         mlp_bias=options.bias)


def check(cfg: ModelConfig) -> None:
    options = read_options(cfg, FalconOptions)
    check_option("parallel_attn", options.parallel_attn, bool)
    check_option("norms", options.norms, int, lambda n: n in (1, 2) and (n == 2 or options.parallel_attn))
    check_option("bias", options.bias, bool)
    check_option("activation", options.activation, str, lambda a: a in GELU)


# --- config.json ----------------------------------------------------------------------------------
def config_from_hf(hf: dict, where: str) -> ModelConfig:
    refuse_set(hf, where, "alibi", "apply_residual_connection_post_layernorm")
    check_choice(hf, where, "activation", tuple(GELU), "gelu")
    d, heads = hf.get("hidden_size") or hf.get("n_embed") or 4544, hf.get("num_attention_heads", 71)
    parallel, kv_heads, norms = layout_from_hf(hf, where, heads)
    options = FalconOptions(parallel, norms, bool(hf.get("bias", False)), hf.get("activation", "gelu"))
    return ModelConfig(vocab_size=hf.get("vocab_size", 65024), n_layers=hf.get("num_hidden_layers", 32), d_model=d,
                       n_heads=heads, n_kv_heads=kv_heads, d_ff=hf.get("ffn_hidden_size") or 4 * d,
                       max_seq_len=hf.get("max_position_embeddings", DEFAULT_POSITIONS), norm="layernorm",
                       position="rope", mlp="gelu", tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                       bias=False, norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                       rope_theta=default_rope_theta_from_hf(hf, where), family=NAME, family_options=vars(options))


def layout_from_hf(hf: dict, where: str, heads: int) -> tuple[bool, int, int]:
    """(parallel_attn, KV heads, norms) as transformers' FalconDecoderLayer builds them; the layouts
    it builds but cannot run (its forward reads norms the layer lacks, or repeats K/V past the
    heads it has) refused by their key."""
    parallel, groups = hf.get("parallel_attn", True), hf.get("num_kv_heads") or heads
    one_or_two = hf.get("num_ln_in_parallel_attn")
    if hf.get("new_decoder_architecture"):
        if not parallel:
            raise ConfigError(f"{where}: config.json: parallel_attn=False is not supported with "
                              f"new_decoder_architecture (transformers' Falcon cannot run it)")
        if one_or_two not in (None, 1, 2):
            raise ConfigError(f"{where}: config.json: num_ln_in_parallel_attn={one_or_two!r} is not supported; "
                              f"valid: 1, 2")
        return True, groups, one_or_two or 2
    if parallel and one_or_two not in (None, 1):
        raise ConfigError(f"{where}: config.json: num_ln_in_parallel_attn={one_or_two!r} is not supported without "
                          f"new_decoder_architecture (transformers' Falcon reads one norm there)")
    if not hf.get("multi_query", True) and groups != heads:
        raise ConfigError(f"{where}: config.json: num_kv_heads={groups!r} is not supported without multi_query "
                          f"nor new_decoder_architecture (every head has its own K/V there)")
    return bool(parallel), 1 if hf.get("multi_query", True) else heads, 1 if parallel else 2


def config_to_hf(cfg: ModelConfig, original: dict) -> dict:
    options, kv_heads, heads = read_options(cfg, FalconOptions), cfg.kv_heads, cfg.n_heads
    # the original layout when it says so; else the old one when it can hold the model (Falcon-7B's)
    new = bool(original.get("new_decoder_architecture")) or needs_new_architecture(cfg)
    hf = dict(original)
    hf.update(model_type="falcon", architectures=hf.get("architectures") or ["FalconForCausalLM"],
              vocab_size=cfg.vocab_size, num_hidden_layers=cfg.n_layers, hidden_size=cfg.d_model,
              num_attention_heads=heads, ffn_hidden_size=cfg.d_ff,
              max_position_embeddings=cfg.max_seq_len, layer_norm_epsilon=cfg.norm_eps,
              tie_word_embeddings=cfg.tie_embeddings, bias=options.bias, activation=options.activation,
              parallel_attn=options.parallel_attn, new_decoder_architecture=new, alibi=False)
    hf.pop("n_embed", None)  # FalconConfig's older name of hidden_size
    if new:
        hf.update(num_kv_heads=kv_heads, num_ln_in_parallel_attn=options.norms)
    else:  # one K/V head, or one per head (either when there is one head); num_kv_heads unread
        hf["multi_query"] = kv_heads == 1 and (heads > 1 or bool(original.get("multi_query", True)))
    if "num_key_value_heads" in hf:  # what transformers writes for the K/V heads computed
        hf["num_key_value_heads"] = kv_heads
    default_rope_to_hf(hf, cfg, original)
    return hf


def needs_new_architecture(cfg: ModelConfig) -> bool:
    """Whether only new_decoder_architecture holds the model: the MLP's own norm beside the
    attention, or K/V heads other than one or one per head."""
    options = read_options(cfg, FalconOptions)
    return (options.parallel_attn and options.norms == 2) or cfg.kv_heads not in (1, cfg.n_heads)


# --- tensors --------------------------------------------------------------------------------------
def split_per_group(fused: torch.Tensor, kv_heads: int, heads: int, head_dim: int) -> tuple:
    """A fused q/k/v laid out per KV group, output rows (kv_heads, heads/kv_heads + 2, head_dim) ->
    strata's q (heads x head_dim rows, group by group), k and v (kv_heads x head_dim each)."""
    grouped = fused.view(kv_heads, heads // kv_heads + 2, head_dim, *fused.shape[1:])
    return tuple(part.reshape(-1, *fused.shape[1:]).contiguous()
                 for part in (grouped[:, :-2], grouped[:, -2], grouped[:, -1]))


def join_per_group(q, k, v, kv_heads: int, head_dim: int) -> torch.Tensor:
    """The inverse of split_per_group, bit for bit."""
    rest = q.shape[1:]
    grouped = torch.cat([q.reshape(kv_heads, -1, head_dim, *rest), k.reshape(kv_heads, 1, head_dim, *rest),
                         v.reshape(kv_heads, 1, head_dim, *rest)], dim=1)
    return grouped.reshape(-1, *rest)


def tensors_from_hf(hf_tensors: dict, cfg: ModelConfig, where: str) -> dict:
    out, layer = {}, {**LAYER, **NORMS_READ}
    for name, value in strip_prefix(hf_tensors)[0].items():
        if name == HEAD:
            if not cfg.tie_embeddings:  # a tied model's file may hold the head anyway
                out["head.weight"] = value
            continue
        fused = name_from_hf(name, {FUSED: "attn.qkv"}, {}, BLOCKS)
        if fused is not None:
            parts = split_per_group(value, cfg.kv_heads, cfg.n_heads, cfg.head_dim)
            out.update({fused.replace(".qkv.", f".{proj}."): part for proj, part in zip(("wq", "wk", "wv"), parts)})
            continue
        strata_name = name_from_hf(name, layer, TOP, BLOCKS)
        if strata_name is None:
            raise ConfigError(f"{where}: unexpected tensor {name!r} for a Falcon model")
        out[strata_name] = value
    return out


def norm_names(cfg: ModelConfig) -> dict:
    """Falcon's names of the block's norms in this model's layout."""
    options = read_options(cfg, FalconOptions)
    if options.parallel_attn and options.norms == 2:
        return {"ln_attn": "attn_norm", "ln_mlp": "mlp_norm"}
    return {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}


def tensors_to_hf(tensors: dict, cfg: ModelConfig, keys: list | None) -> dict:
    prefix = written_prefix(keys)

    def block_value(module: str, leaf: str, value):
        return None if module in ("attn.wq", "attn.wk", "attn.wv") else value  # fused below
    body = {name: value for name, value in tensors.items() if name != "head.weight"}
    out = names_to_hf(body, {**LAYER, **norm_names(cfg)}, TOP, BLOCKS, prefix, block_value)
    for block in range(cfg.n_layers):
        for leaf in ("weight", "bias") if read_options(cfg, FalconOptions).bias else ("weight",):
            q, k, v = (tensors[f"blocks.{block}.attn.{p}.{leaf}"] for p in ("wq", "wk", "wv"))
            out[f"{prefix}{BLOCKS}{block}.{FUSED}.{leaf}"] = join_per_group(q, k, v, cfg.kv_heads, cfg.head_dim)
    head_to_hf(out, tensors, cfg, keys, HEAD)
    return out


FAMILY = Family(NAME, ("falcon",), TENSOR_PARALLEL, config_from_hf, config_to_hf, tensors_from_hf, tensors_to_hf,
                block=OwnBlock(**described(block_shape, check)))
