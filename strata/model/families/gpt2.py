"""GPT-2 (OpenAI; also GPT-3's shapes): LayerNorm, learned positions, the tanh GELU, biases on
every linear layer, the head tied to the token embedding.

Its Conv1D weights are stored (in, out): they are transposed; the fused c_attn is split into q,
k and v (and joined back). Files saved with or without the "transformer." prefix both read, and
are written back under the names they came with."""

from __future__ import annotations

import torch

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

NAME = "gpt2"
LAYER = {"ln_1": "attn_norm", "ln_2": "mlp_norm", "attn.c_proj": "attn.wo", "mlp.c_fc": "mlp.w_in",
         "mlp.c_proj": "mlp.w_out"}
TOP = {"wte.weight": "embed.weight", "wpe.weight": "pos_embed.weight", "ln_f.weight": "final_norm.weight",
       "ln_f.bias": "final_norm.bias"}
BLOCKS = "h."  # block N's tensors are under h.N (after the "transformer." prefix, when a file has it)
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
# Megatron's split, as Llama's, with the GELU MLP's two matrices
BLOCK_TENSOR_PARALLEL = in_blocks({"attn_norm": "input_norm", "attn.wq": "column", "attn.wk": "kv_column",
                                   "attn.wv": "kv_column", "attn.wo": "row", "mlp_norm": "input_norm",
                                   "mlp.w_in": "column", "mlp.w_out": "row"})
TENSOR_PARALLEL = {"embed": "vocabulary", "pos_embed": "replicated", "final_norm": "input_norm",
                   **BLOCK_TENSOR_PARALLEL}


def config_from_hf(hf: dict, where: str) -> ModelConfig:
    check_choice(hf, where, "activation_function", TANH_GELU, "gelu_new")
    refuse_set(hf, where, "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn")
    d = hf["n_embd"]
    return ModelConfig(vocab_size=hf["vocab_size"], n_layers=hf["n_layer"], d_model=d, n_heads=hf["n_head"],
                       d_ff=hf.get("n_inner") or 4 * d, max_seq_len=hf["n_positions"], norm="layernorm",
                       position="learned", mlp="gelu", tie_embeddings=True, bias=True,
                       norm_eps=hf.get("layer_norm_epsilon", 1e-5), family=NAME)


def config_to_hf(cfg: ModelConfig, original: dict) -> dict:
    hf = dict(original)
    hf.update(model_type="gpt2", architectures=hf.get("architectures") or ["GPT2LMHeadModel"],
              vocab_size=cfg.vocab_size, n_layer=cfg.n_layers, n_embd=cfg.d_model, n_head=cfg.n_heads,
              n_inner=cfg.d_ff, n_positions=cfg.max_seq_len, layer_norm_epsilon=cfg.norm_eps,
              activation_function=hf.get("activation_function", "gelu_new"), tie_word_embeddings=True)
    return hf


def strip_prefix(hf_tensors: dict, prefix: str = "transformer.") -> tuple[dict, str]:
    """Names without the base model's prefix, and the prefix the file used ("" when none)."""
    if not any(k.startswith(prefix) for k in hf_tensors):
        return dict(hf_tensors), ""
    return {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in hf_tensors.items()}, prefix


def written_prefix(keys: list | None, prefix: str = "transformer.") -> str:
    """The prefix to write: the original file's, or transformers' own for a new file."""
    return prefix if keys is None or any(k.startswith(prefix) for k in keys) else ""


def tensors_from_hf(hf_tensors: dict, cfg: ModelConfig, where: str) -> dict:
    out = {}
    for name, value in strip_prefix(hf_tensors)[0].items():
        if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # the tied head, and old causal-mask buffers
        if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
            block, leaf = name.split(".")[1], name.rsplit(".", 1)[1]
            parts = (value.t() if leaf == "weight" else value).chunk(3, dim=0)
            for proj, part in zip(("wq", "wk", "wv"), parts):
                out[f"blocks.{block}.attn.{proj}.{leaf}"] = part.contiguous()
            continue
        strata_name = name_from_hf(name, LAYER, TOP, BLOCKS)
        if strata_name is None:
            raise ConfigError(f"{where}: unexpected tensor {name!r} for a GPT-2 model")
        if strata_name.startswith("blocks.") and _conv1d(*strata_name.split(".", 2)[2].rsplit(".", 1)):
            value = value.t().contiguous()
        out[strata_name] = value
    return out


def _conv1d(module: str, leaf: str) -> bool:
    """Whether a block tensor (strata's module path, leaf) is a Conv1D weight, stored (in, out)."""
    return leaf == "weight" and module not in ("attn_norm", "mlp_norm")


def unfused_to_hf(tensors: dict, layer: dict, top: dict, prefix: str, conv1d: bool) -> dict:
    """strata's tensors but q, k and v (fused by the caller) under the names of a family that keeps
    its blocks in `h.N` (GPT-2, BLOOM); conv1d: weights other than the norms' stored (in, out)."""
    def block_value(module: str, leaf: str, value):
        if module in ("attn.wq", "attn.wk", "attn.wv"):
            return None
        return value.t().contiguous() if conv1d and _conv1d(module, leaf) else value
    return names_to_hf(tensors, layer, top, BLOCKS, prefix, block_value)


def tensors_to_hf(tensors: dict, cfg: ModelConfig, keys: list | None) -> dict:
    prefix = written_prefix(keys)
    out = unfused_to_hf(tensors, LAYER, TOP, prefix, conv1d=True)
    for block in range(cfg.n_layers):
        q, k, v = (tensors[f"blocks.{block}.attn.{p}.weight"] for p in ("wq", "wk", "wv"))
        out[f"{prefix}h.{block}.attn.c_attn.weight"] = torch.cat([q, k, v]).t().contiguous()
        out[f"{prefix}h.{block}.attn.c_attn.bias"] = torch.cat(
            [tensors[f"blocks.{block}.attn.{p}.bias"] for p in ("wq", "wk", "wv")])
    tied_head_to_hf(out, tensors, cfg, keys, "lm_head.weight")
    return out


FAMILY = Family(NAME, ("gpt2",), TENSOR_PARALLEL, config_from_hf, config_to_hf, tensors_from_hf, tensors_to_hf)
