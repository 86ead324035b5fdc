"""GPT-J (Wang & Komatsuzaki 2021: EleutherAI's GPT-J-6B): the parallel block with one LayerNorm,
x + attn(ln_1(x)) + mlp(ln_1(x)) (strata/model/parallel_block.py), rotary positions on the first
`rotary_dim` features of each head in interleaved pairs (64 of 256 in GPT-J-6B), no biases on q, k,
v and the output projection, an MLP with biases and the tanh GELU, an untied head with a bias (the
shared `bias` field: the head's).

Its one option, rotary_dim, is GPT-J's own (cfg.family_options, GPTJOptions); a head narrower than
it rotates whole (transformers' GPT-J cannot run that, so such a model does not export). q, k and v
are stored apart already: every tensor only changes its name. Files with or without the
"transformer." prefix both read, and are written back under the names they came with."""

from __future__ import annotations

from dataclasses import dataclass

from strata.errors import ConfigError
from strata.model.config import ModelConfig
from strata.model.families.base import (
    Family,
    OwnBlock,
    check_choice,
    check_option,
    in_blocks,
    name_from_hf,
    names_to_hf,
    read_options,
    refuse_set,
)
from strata.model.families.gpt2 import TANH_GELU, strip_prefix, written_prefix
from strata.model.parallel_block import ParallelShape, described

NAME = "gptj"
LAYER = {"ln_1": "attn_norm", "attn.q_proj": "attn.wq", "attn.k_proj": "attn.wk", "attn.v_proj": "attn.wv",
         "attn.out_proj": "attn.wo", "mlp.fc_in": "mlp.w_in", "mlp.fc_out": "mlp.w_out"}
TOP = {"wte.weight": "embed.weight", "ln_f.weight": "final_norm.weight", "ln_f.bias": "final_norm.bias"}
HEAD = {"lm_head.weight": "head.weight", "lm_head.bias": "head.bias"}  # outside the base model's prefix
BLOCKS = "h."  # block N's tensors are under h.N (after the "transformer." prefix, when a file has it)
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")  # old files' causal masks: not weights
# Megatron's split; the one norm's input conversion serves q, k, v and the MLP's first matrix.
TENSOR_PARALLEL = {"embed": "vocabulary", "head": "vocabulary", "final_norm": "input_norm",
                   **in_blocks({"attn_norm": "input_norm", "attn.wq": "column", "attn.wk": "kv_column",
                                "attn.wv": "kv_column", "attn.wo": "row", "mlp.w_in": "column", "mlp.w_out": "row"})}


@dataclass(frozen=True)
class GPTJOptions:
    rotary_dim: int  # each head's features that rotate, in pairs from the first (GPT-J-6B: 64 of 256)


def block_shape(cfg: ModelConfig) -> ParallelShape:
    rotary_dim = min(read_options(cfg, GPTJOptions).rotary_dim, cfg.head_dim)
    return ParallelShape(rotary_dim, interleaved=True, parallel=True, one_norm=True, attention_bias=False, gelu="tanh")


def check(cfg: ModelConfig) -> None:
    check_option("rotary_dim", read_options(cfg, GPTJOptions).rotary_dim, int, lambda n: n >= 2 and n % 2 == 0)


# --- config.json ----------------------------------------------------------------------------------
def config_from_hf(hf: dict, where: str) -> ModelConfig:
    check_choice(hf, where, "activation_function", TANH_GELU, "gelu_new")
    refuse_set(hf, where, "tie_word_embeddings")  # its head has a bias, which a tied head lacks
    d, heads = hf["n_embd"], hf["n_head"]
    rotary_dim = hf.get("rotary_dim", 64)  # GPTJConfig's default
    # transformers' GPT-J rotates whole d_model-wide tables into each head without it (None), and
    # cannot rotate more than a head has
    if not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool) or rotary_dim < 2 or rotary_dim % 2 or \
            rotary_dim > d // heads:
        raise ConfigError(f"{where}: config.json: rotary_dim={rotary_dim!r} is not supported (an even number "
                          f"of features, at most a head's {d // heads})")
    return ModelConfig(vocab_size=hf["vocab_size"], n_layers=hf["n_layer"], d_model=d, n_heads=heads,
                       d_ff=hf.get("n_inner") or 4 * d, max_seq_len=hf["n_positions"], norm="layernorm",
                       position="rope", mlp="gelu", tie_embeddings=False, bias=True,
                       norm_eps=hf.get("layer_norm_epsilon", 1e-5), family=NAME,
                       family_options={"rotary_dim": rotary_dim})


def config_to_hf(cfg: ModelConfig, original: dict) -> dict:
    hf = dict(original)
    hf.update(model_type="gptj", architectures=hf.get("architectures") or ["GPTJForCausalLM"],
              vocab_size=cfg.vocab_size, n_layer=cfg.n_layers, n_embd=cfg.d_model, n_head=cfg.n_heads,
              n_inner=cfg.d_ff, n_positions=cfg.max_seq_len, layer_norm_epsilon=cfg.norm_eps,
              rotary_dim=read_options(cfg, GPTJOptions).rotary_dim,
              activation_function=hf.get("activation_function", "gelu_new"), tie_word_embeddings=False)
    return hf


# --- tensors --------------------------------------------------------------------------------------
def tensors_from_hf(hf_tensors: dict, cfg: ModelConfig, where: str) -> dict:
    out = {}
    for name, value in strip_prefix(hf_tensors)[0].items():
        if name.endswith(MASK_BUFFERS):
            continue
        strata_name = HEAD.get(name) or name_from_hf(name, LAYER, TOP, BLOCKS)
        if strata_name is None:
            raise ConfigError(f"{where}: unexpected tensor {name!r} for a GPT-J model")
        out[strata_name] = value
    return out


def tensors_to_hf(tensors: dict, cfg: ModelConfig, keys: list | None) -> dict:
    body = {name: value for name, value in tensors.items() if name not in HEAD.values()}
    out = names_to_hf(body, LAYER, TOP, BLOCKS, written_prefix(keys))
    out.update({theirs: tensors[ours] for theirs, ours in HEAD.items()})
    return out


FAMILY = Family(NAME, ("gptj",), TENSOR_PARALLEL, config_from_hf, config_to_hf, tensors_from_hf, tensors_to_hf,
                block=OwnBlock(**described(block_shape, check)))
