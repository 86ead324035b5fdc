"""StarCoder (BigCode: Li et al. 2023; SantaCoder, StarCoderBase; model_type "gpt_bigcode"): GPT-2's
block computed by strata's shared Block (LayerNorm, learned positions, the tanh GELU, biases on
every linear layer, the head tied to the embedding) with multi-query attention: one K/V head for
every query head (n_kv_heads 1; multi_query false: one per head). Under tensor parallelism K and V
are whole on every rank (kv_column), as any model's with fewer KV heads than ranks.

Its weights are nn.Linear's (out, in), not GPT-2's Conv1D: no transposes. The fused c_attn is
[q (n_embd rows), k (head_dim), v (head_dim)] under multi-query, (heads, 3, head_dim) per head
without: both are Falcon's per-group layout (one group, or one per head), split and joined by its
functions. Files with or without the "transformer." prefix both read, and are written back under
the names they came with."""

from __future__ import annotations

from strata.errors import ConfigError
from strata.model.config import ModelConfig
from strata.model.families.base import Family, check_choice, name_from_hf, refuse_set, tied_head_to_hf
from strata.model.families.falcon import join_per_group, split_per_group
from strata.model.families.gpt2 import LAYER, TENSOR_PARALLEL, TOP, strip_prefix, unfused_to_hf, written_prefix

NAME = "gpt_bigcode"
FUSED = "attn.c_attn"
# the tanh GELU under its names (gelu_fast: the same formula, written with 0.7978845608)
TANH_GELU = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")
MASK_BUFFERS = ("bias", "masked_bias")  # the base model's causal mask, which old files saved: not weights


def config_from_hf(hf: dict, where: str) -> ModelConfig:
    check_choice(hf, where, "activation_function", TANH_GELU, "gelu_pytorch_tanh")
    refuse_set(hf, where, "add_cross_attention")
    for key in ("scale_attn_weights", "tie_word_embeddings"):  # on by default; strata computes them on
        if not hf.get(key, True):  # an untied head: transformers' has no bias, strata's shared one has
            raise ConfigError(f"{where}: config.json: {key}={hf[key]!r} is not supported")
    d, heads = hf["n_embd"], hf["n_head"]
    return ModelConfig(vocab_size=hf["vocab_size"], n_layers=hf["n_layer"], d_model=d, n_heads=heads,
                       n_kv_heads=1 if hf.get("multi_query", True) else heads, d_ff=hf.get("n_inner") or 4 * d,
                       max_seq_len=hf["n_positions"], norm="layernorm", position="learned", mlp="gelu",
                       tie_embeddings=True, bias=True, norm_eps=hf.get("layer_norm_epsilon", 1e-5), family=NAME)


def config_to_hf(cfg: ModelConfig, original: dict) -> dict:
    hf = dict(original)
    hf.update(model_type="gpt_bigcode", architectures=hf.get("architectures") or ["GPTBigCodeForCausalLM"],
              vocab_size=cfg.vocab_size, n_layer=cfg.n_layers, n_embd=cfg.d_model, n_head=cfg.n_heads,
              n_inner=cfg.d_ff, n_positions=cfg.max_seq_len, layer_norm_epsilon=cfg.norm_eps,
              activation_function=hf.get("activation_function", "gelu_pytorch_tanh"), tie_word_embeddings=True,
              multi_query=cfg.kv_heads == 1 and (cfg.n_heads > 1 or bool(original.get("multi_query", True))))
    if "num_key_value_heads" in hf:  # what transformers writes for the K/V heads computed
        hf["num_key_value_heads"] = cfg.kv_heads
    return hf


def tensors_from_hf(hf_tensors: dict, cfg: ModelConfig, where: str) -> dict:
    out = {}
    for name, value in strip_prefix(hf_tensors)[0].items():
        if name == "lm_head.weight" or name in MASK_BUFFERS:
            continue  # the tied head, and old causal-mask buffers
        fused = name_from_hf(name, {FUSED: "attn.qkv"}, {}, "h.")
        if fused is not None:
            parts = split_per_group(value, cfg.kv_heads, cfg.n_heads, cfg.head_dim)
            out.update({fused.replace(".qkv.", f".{proj}."): part for proj, part in zip(("wq", "wk", "wv"), parts)})
            continue
        strata_name = name_from_hf(name, LAYER, TOP, "h.")
        if strata_name is None:
            raise ConfigError(f"{where}: unexpected tensor {name!r} for a GPTBigCode model")
        out[strata_name] = value
    return out


def tensors_to_hf(tensors: dict, cfg: ModelConfig, keys: list | None) -> dict:
    prefix = written_prefix(keys)
    out = unfused_to_hf(tensors, LAYER, TOP, prefix, conv1d=False)
    for block in range(cfg.n_layers):
        for leaf in ("weight", "bias"):
            q, k, v = (tensors[f"blocks.{block}.attn.{p}.{leaf}"] for p in ("wq", "wk", "wv"))
            out[f"{prefix}h.{block}.{FUSED}.{leaf}"] = join_per_group(q, k, v, cfg.kv_heads, cfg.head_dim)
    tied_head_to_hf(out, tensors, cfg, keys, "lm_head.weight")
    return out


FAMILY = Family(NAME, ("gpt_bigcode",), TENSOR_PARALLEL, config_from_hf, config_to_hf, tensors_from_hf, tensors_to_hf)
