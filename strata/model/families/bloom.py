"""BLOOM (BigScience 2022): LayerNorm, a LayerNorm right after the token embedding
(word_embeddings_layernorm), ALiBi instead of position embeddings, the tanh GELU with a 4x MLP,
biases everywhere, the head tied to the embedding.

Its fused query_key_value is laid out per head: output rows (heads, 3, head_dim), q, k and v of
head 0, then of head 1, ... (transformers' BloomAttention._reshape); it is split into strata's
q, k and v and interleaved back. Files with or without the "transformer." prefix both read.

ALiBi's slopes are a buffer per head, not a parameter: under tensor parallelism each rank takes
the slopes of the heads it holds."""

from __future__ import annotations

from strata.errors import ConfigError
from strata.model.config import ModelConfig
from strata.model.families.base import Family, join_per_head, name_from_hf, put_fused_qkv, refuse_set, tied_head_to_hf
from strata.model.families.gpt2 import BLOCK_TENSOR_PARALLEL, BLOCKS, strip_prefix, unfused_to_hf, written_prefix

NAME = "bloom"
LAYER = {"input_layernorm": "attn_norm", "self_attention.dense": "attn.wo", "post_attention_layernorm": "mlp_norm",
         "mlp.dense_h_to_4h": "mlp.w_in", "mlp.dense_4h_to_h": "mlp.w_out"}
TOP = {"word_embeddings.weight": "embed.weight", "word_embeddings_layernorm.weight": "embed_norm.weight",
       "word_embeddings_layernorm.bias": "embed_norm.bias", "ln_f.weight": "final_norm.weight",
       "ln_f.bias": "final_norm.bias"}
FUSED = "self_attention.query_key_value"
# GPT-2's split; the embedding's norm sees whole sequences (before sequence parallelism splits them).
# ALiBi's slopes are per head: each rank takes its heads' (Transformer.keep_heads).
TENSOR_PARALLEL = {"embed": "vocabulary", "embed_norm": "replicated", "final_norm": "input_norm",
                   **BLOCK_TENSOR_PARALLEL}
# ALiBi needs no position table; BLOOM was trained on 2,048-token sequences (BigScience 2022)
TRAINED_CONTEXT = 2048


def config_from_hf(hf: dict, where: str) -> ModelConfig:
    refuse_set(hf, where, "apply_residual_connection_post_layernorm")
    d = hf.get("hidden_size") or hf["n_embed"]  # n_embed: BloomConfig's older name
    return ModelConfig(vocab_size=hf["vocab_size"], n_layers=hf["n_layer"], d_model=d, n_heads=hf["n_head"],
                       d_ff=4 * d, max_seq_len=hf.get("seq_length") or TRAINED_CONTEXT, norm="layernorm",
                       position="alibi", mlp="gelu", tie_embeddings=True, bias=True, embedding_norm=True,
                       norm_eps=hf.get("layer_norm_epsilon", 1e-5), family=NAME)


def config_to_hf(cfg: ModelConfig, original: dict) -> dict:
    hf = {k: v for k, v in original.items() if k != "n_embed"}
    hf.update(model_type="bloom", architectures=hf.get("architectures") or ["BloomForCausalLM"],
              vocab_size=cfg.vocab_size, n_layer=cfg.n_layers, hidden_size=cfg.d_model, n_head=cfg.n_heads,
              layer_norm_epsilon=cfg.norm_eps, seq_length=cfg.max_seq_len, tie_word_embeddings=True)
    return hf


def tensors_from_hf(hf_tensors: dict, cfg: ModelConfig, where: str) -> dict:
    heads, head_dim = cfg.n_heads, cfg.head_dim
    out = {}
    for name, value in strip_prefix(hf_tensors)[0].items():
        if name == "lm_head.weight":
            continue  # tied
        if put_fused_qkv(out, name, value, FUSED, BLOCKS, heads, head_dim):
            continue
        strata_name = name_from_hf(name, LAYER, TOP, BLOCKS)
        if strata_name is None:
            raise ConfigError(f"{where}: unexpected tensor {name!r} for a BLOOM model")
        out[strata_name] = value
    return out


def tensors_to_hf(tensors: dict, cfg: ModelConfig, keys: list | None) -> dict:
    prefix, heads, head_dim = written_prefix(keys), cfg.n_heads, cfg.head_dim
    out = unfused_to_hf(tensors, LAYER, TOP, prefix, conv1d=False)
    for block in range(cfg.n_layers):
        for leaf in ("weight", "bias"):
            q, k, v = (tensors[f"blocks.{block}.attn.{p}.{leaf}"] for p in ("wq", "wk", "wv"))
            out[f"{prefix}h.{block}.{FUSED}.{leaf}"] = join_per_head(q, k, v, heads, head_dim)
    tied_head_to_hf(out, tensors, cfg, keys, "lm_head.weight")
    return out


FAMILY = Family(NAME, ("bloom",), TENSOR_PARALLEL, config_from_hf, config_to_hf, tensors_from_hf, tensors_to_hf)
