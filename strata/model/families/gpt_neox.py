"""GPT-NeoX (Black et al. 2022: GPT-NeoX-20B; Biderman et al. 2023: the Pythia suite): the parallel
block with two LayerNorms, x + attn(ln_1(x)) + mlp(ln_2(x)) (strata/model/parallel_block.py; the
shared Block's order when use_parallel_residual is false), rotary positions on the first
int(head_dim · rotary_pct) features of each head in two halves (a quarter in Pythia), biases on
every linear layer of the block (attention_bias), the exact GELU (Pythia's "gelu"; GPT-NeoX-20B's
"gelu_fast" is the tanh one), an untied head without a bias (`embed_out`).

Its fused query_key_value is laid out per head, output rows (heads, 3, head_dim), as BLOOM's
(transformers' GPTNeoXAttention views it (..., heads, 3·head_dim) and chunks the last dimension):
split into strata's q, k and v and joined back bit for bit. Its options (rotary_pct, the parallel
residual, attention_bias, hidden_act) are GPT-NeoX's own (cfg.family_options, NeoXOptions).
Released files hold the head as `embed_out` (transformers 5 renames it lm_head in memory); both read,
and it is written back under the name it came with."""

from __future__ import annotations

from dataclasses import dataclass

from strata.errors import ConfigError
from strata.model.config import ModelConfig
from strata.model.families.base import (
    Family,
    OwnBlock,
    check_choice,
    check_option,
    default_rope_from_hf,
    head_to_hf,
    join_per_head,
    name_from_hf,
    names_to_hf,
    put_fused_qkv,
    read_options,
)
from strata.model.families.gpt2 import BLOCK_TENSOR_PARALLEL, strip_prefix, written_prefix
from strata.model.parallel_block import ParallelShape, described

NAME = "gpt_neox"
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm", "attention.dense": "attn.wo",
         "mlp.dense_h_to_4h": "mlp.w_in", "mlp.dense_4h_to_h": "mlp.w_out"}
FUSED = "attention.query_key_value"
TOP = {"embed_in.weight": "embed.weight", "final_layer_norm.weight": "final_norm.weight",
       "final_layer_norm.bias": "final_norm.bias"}
HEADS = ("embed_out.weight", "lm_head.weight")  # outside the base model's prefix: the released name first
PREFIX, BLOCKS = "gpt_neox.", "layers."
DERIVED = (".attention.rotary_emb.inv_freq", ".attention.bias", ".attention.masked_bias")  # old files' buffers
TENSOR_PARALLEL = {"embed": "vocabulary", "head": "vocabulary", "final_norm": "input_norm", **BLOCK_TENSOR_PARALLEL}
# hidden_act -> the GELU computed ("gelu_fast" is the tanh approximation, written with 0.7978845608)
GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_fast": "tanh", "gelu_pytorch_tanh": "tanh"}


@dataclass(frozen=True)
class NeoXOptions:
    rotary_pct: float  # the fraction of each head's features that rotate (Pythia: 0.25)
    parallel_residual: bool  # use_parallel_residual: attention and MLP from one residual
    attention_bias: bool  # biases on query_key_value and dense
    hidden_act: str  # one of GELU


def block_shape(cfg: ModelConfig) -> ParallelShape:
    options = read_options(cfg, NeoXOptions)
    return ParallelShape(int(cfg.head_dim * options.rotary_pct), interleaved=False,
                         parallel=options.parallel_residual, one_norm=False, attention_bias=options.attention_bias,
                         gelu=GELU.get(options.hidden_act, options.hidden_act))


def check(cfg: ModelConfig) -> None:
    options = read_options(cfg, NeoXOptions)
    check_option("rotary_pct", options.rotary_pct, float, lambda p: 0 <= p <= 1)
    check_option("parallel_residual", options.parallel_residual, bool)
    check_option("attention_bias", options.attention_bias, bool)
    check_option("hidden_act", options.hidden_act, str, lambda a: a in GELU)


# --- config.json ----------------------------------------------------------------------------------
def config_from_hf(hf: dict, where: str) -> ModelConfig:
    check_choice(hf, where, "hidden_act", tuple(GELU), "gelu")
    rope = default_rope_from_hf(hf, where)
    rotary_pct = rope.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))
    if isinstance(rotary_pct, bool) or not isinstance(rotary_pct, (int, float)) or not 0 <= rotary_pct <= 1:
        raise ConfigError(f"{where}: config.json: rotary_pct={rotary_pct!r} must be a fraction of each head")
    options = NeoXOptions(rotary_pct, bool(hf.get("use_parallel_residual", True)),
                          bool(hf.get("attention_bias", True)), hf.get("hidden_act", "gelu"))
    return ModelConfig(vocab_size=hf["vocab_size"], n_layers=hf["num_hidden_layers"], d_model=hf["hidden_size"],
                       n_heads=hf["num_attention_heads"], d_ff=hf["intermediate_size"],
                       max_seq_len=hf["max_position_embeddings"], norm="layernorm", position="rope", mlp="gelu",
                       tie_embeddings=bool(hf.get("tie_word_embeddings", False)), bias=False,
                       norm_eps=hf.get("layer_norm_eps", 1e-5),
                       rope_theta=rope.get("rope_theta", hf.get("rotary_emb_base", 10000.0)), family=NAME,
                       family_options=vars(options))


def config_to_hf(cfg: ModelConfig, original: dict) -> dict:
    options = read_options(cfg, NeoXOptions)
    hf = dict(original)
    hf.update(model_type="gpt_neox", architectures=hf.get("architectures") or ["GPTNeoXForCausalLM"],
              vocab_size=cfg.vocab_size, num_hidden_layers=cfg.n_layers, hidden_size=cfg.d_model,
              num_attention_heads=cfg.n_heads, intermediate_size=cfg.d_ff, max_position_embeddings=cfg.max_seq_len,
              layer_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
              use_parallel_residual=options.parallel_residual, attention_bias=options.attention_bias,
              hidden_act=options.hidden_act)
    if "rope_parameters" in hf or not original:  # transformers 5's form
        hf["rope_parameters"] = {**(hf.get("rope_parameters") or {}), "rope_type": "default",
                                 "rope_theta": cfg.rope_theta, "partial_rotary_factor": options.rotary_pct}
    else:  # the form the original was written in (Pythia's files)
        hf.update(rotary_pct=options.rotary_pct, rotary_emb_base=cfg.rope_theta)
    return hf


# --- tensors --------------------------------------------------------------------------------------
def tensors_from_hf(hf_tensors: dict, cfg: ModelConfig, where: str) -> dict:
    out = {}
    for name, value in strip_prefix(hf_tensors, PREFIX)[0].items():
        if name in HEADS:
            if not cfg.tie_embeddings:  # a tied model's file may hold the head anyway
                out["head.weight"] = value
            continue
        if name.endswith(DERIVED):
            continue
        if put_fused_qkv(out, name, value, FUSED, BLOCKS, cfg.n_heads, cfg.head_dim):
            continue
        strata_name = name_from_hf(name, LAYER, TOP, BLOCKS)
        if strata_name is None:
            raise ConfigError(f"{where}: unexpected tensor {name!r} for a GPT-NeoX model")
        out[strata_name] = value
    return out


def tensors_to_hf(tensors: dict, cfg: ModelConfig, keys: list | None) -> dict:
    prefix = written_prefix(keys, PREFIX)

    def block_value(module: str, leaf: str, value):
        return None if module in ("attn.wq", "attn.wk", "attn.wv") else value  # fused below
    body = {name: value for name, value in tensors.items() if name != "head.weight"}
    out = names_to_hf(body, LAYER, TOP, BLOCKS, prefix, block_value)
    for block in range(cfg.n_layers):
        for leaf in ("weight", "bias") if read_options(cfg, NeoXOptions).attention_bias else ("weight",):
            q, k, v = (tensors[f"blocks.{block}.attn.{p}.{leaf}"] for p in ("wq", "wk", "wv"))
            out[f"{prefix}{BLOCKS}{block}.{FUSED}.{leaf}"] = join_per_head(q, k, v, cfg.n_heads, cfg.head_dim)
    head = next((name for name in HEADS if keys is not None and name in keys), HEADS[0])
    head_to_hf(out, tensors, cfg, keys, head)
    return out


FAMILY = Family(NAME, ("gpt_neox",), TENSOR_PARALLEL, config_from_hf, config_to_hf, tensors_from_hf, tensors_to_hf,
                block=OwnBlock(**described(block_shape, check)))
