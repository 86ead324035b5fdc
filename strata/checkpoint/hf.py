"""Hugging Face interop for the LLaMA and GPT-2 families: `strata convert --from-hf DIR --out CKPT`
and `strata convert --to-hf CKPT --out DIR` (config.json + safetensors, no hub access).

strata's layers were written in Hugging Face's conventions, so most tensors only change names:
- LLaMA: RoPE in the "rotate half" layout (no row permutation of q/k), grouped-query attention
  with num_key_value_heads, RMSNorm, SwiGLU, an untied head unless tie_word_embeddings.
- GPT-2: Conv1D weights are stored (in, out): they are transposed; the fused c_attn is split into
  q, k, v (and joined back); learned positions; the head is tied to the token embedding.
Tensors keep the dtype they came in (fp32 training loads them as fp32 masters), and the original
config.json travels inside the checkpoint: converting back gives the same tensors, bit for bit,
under the same names, and the same config with the shape fields taken from the model."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from strata.checkpoint import shards, store
from strata.errors import ConfigError, CorruptError
from strata.files import check_output_dir, inside, read_json, read_json_object
from strata.model.config import ModelConfig
from strata.model.transformer import build_model

LLAMA_LAYER = {"self_attn.q_proj": "attn.wq", "self_attn.k_proj": "attn.wk", "self_attn.v_proj": "attn.wv",
               "self_attn.o_proj": "attn.wo", "mlp.gate_proj": "mlp.w_gate", "mlp.up_proj": "mlp.w_up",
               "mlp.down_proj": "mlp.w_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "mlp_norm"}
GPT2_LAYER = {"ln_1": "attn_norm", "ln_2": "mlp_norm", "attn.c_proj": "attn.wo", "mlp.c_fc": "mlp.w_in",
              "mlp.c_proj": "mlp.w_out"}
GPT2_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
HF_FILES = ("config.json", "model.safetensors", "tokenizer.json")  # what --to-hf writes
# the config.json keys that count things (a present one must be a whole number >= 1)
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings", "head_dim", "n_embd", "n_layer", "n_head",
              "n_positions", "n_inner")


# --- configs -------------------------------------------------------------------------------------
def model_config_from_hf(hf: dict, where: str) -> ModelConfig:
    """The model a Hugging Face config.json describes; one line naming the key when it cannot."""
    if not isinstance(hf, dict):
        raise ConfigError(f"{where}: config.json holds a JSON {type(hf).__name__}, not an object")
    for key in SHAPE_KEYS:
        value = hf.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{where}: config.json: {key}={value!r} must be a whole number >= 1")
    try:
        cfg = _model_config_from_hf(hf, where)
        cfg.validate()
    except KeyError as e:
        raise ConfigError(f"{where}: config.json has no {e.args[0]!r}") from None
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
        raise ConfigError(f"{where}: config.json does not describe a valid model ({e})") from None
    return cfg


def _model_config_from_hf(hf: dict, where: str) -> ModelConfig:
    kind = hf.get("model_type")
    if kind == "llama":
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ConfigError(f"{where}: rope type {rope.get('rope_type')!r} is not supported (only the default RoPE)")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ConfigError(f"{where}: attention_bias / mlp_bias are not supported for LLaMA models")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{where}: hidden_act {hf['hidden_act']!r}: strata's LLaMA MLP is SwiGLU (silu)")
        heads = hf["num_attention_heads"]
        if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
            raise ConfigError(f"{where}: head_dim {hf['head_dim']} differs from hidden_size / heads; not supported")
        return ModelConfig(vocab_size=hf["vocab_size"], n_layers=hf["num_hidden_layers"], d_model=hf["hidden_size"],
                           n_heads=heads, n_kv_heads=hf.get("num_key_value_heads") or heads,
                           d_ff=hf["intermediate_size"], max_seq_len=hf["max_position_embeddings"],
                           norm="rmsnorm", position="rope", mlp="swiglu",
                           tie_embeddings=bool(hf.get("tie_word_embeddings", False)), bias=False,
                           norm_eps=hf.get("rms_norm_eps", 1e-6),
                           rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "gpt2":
        if hf.get("activation_function", "gelu_new") not in GPT2_TANH_GELU:
            raise ConfigError(f"{where}: activation_function {hf['activation_function']!r}: strata's GPT-2 MLP "
                              f"uses the tanh GELU ({', '.join(GPT2_TANH_GELU)})")
        if hf.get("scale_attn_by_inverse_layer_idx"):
            raise ConfigError(f"{where}: scale_attn_by_inverse_layer_idx is not supported")
        d = hf["n_embd"]
        return ModelConfig(vocab_size=hf["vocab_size"], n_layers=hf["n_layer"], d_model=d, n_heads=hf["n_head"],
                           d_ff=hf.get("n_inner") or 4 * d, max_seq_len=hf["n_positions"], norm="layernorm",
                           position="learned", mlp="gelu", tie_embeddings=True, bias=True,
                           norm_eps=hf.get("layer_norm_epsilon", 1e-5))
    raise ConfigError(f"{where}: model_type {kind!r} is not supported; valid: llama, gpt2")


def hf_config_from_model(cfg: ModelConfig, original: dict | None) -> dict:
    """config.json for a strata model: the original one with the shape fields set from the model."""
    family = _family(cfg)
    hf = dict(original or {})
    if family == "llama":
        hf.update(model_type="llama", architectures=hf.get("architectures") or ["LlamaForCausalLM"],
                  vocab_size=cfg.vocab_size, num_hidden_layers=cfg.n_layers, hidden_size=cfg.d_model,
                  num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads, intermediate_size=cfg.d_ff,
                  max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
                  tie_word_embeddings=cfg.tie_embeddings, head_dim=cfg.head_dim)
        if "rope_parameters" in hf or original is None:
            hf["rope_parameters"] = {**hf.get("rope_parameters", {}), "rope_type": "default", "rope_theta": cfg.rope_theta}
        else:
            hf["rope_theta"] = cfg.rope_theta
    else:
        hf.update(model_type="gpt2", architectures=hf.get("architectures") or ["GPT2LMHeadModel"],
                  vocab_size=cfg.vocab_size, n_layer=cfg.n_layers, n_embd=cfg.d_model, n_head=cfg.n_heads,
                  n_inner=cfg.d_ff, n_positions=cfg.max_seq_len, layer_norm_epsilon=cfg.norm_eps,
                  activation_function=hf.get("activation_function", "gelu_new"), tie_word_embeddings=True)
    return hf


def _family(cfg: ModelConfig) -> str:
    if (cfg.norm, cfg.position, cfg.mlp, cfg.bias, cfg.embedding_norm) == ("rmsnorm", "rope", "swiglu", False, False):
        return "llama"
    if (cfg.norm, cfg.position, cfg.mlp, cfg.tie_embeddings, cfg.bias, cfg.embedding_norm) == \
            ("layernorm", "learned", "gelu", True, True, False):
        return "gpt2"
    raise ConfigError("this model is neither LLaMA-shaped (rmsnorm, rope, swiglu, no biases) nor GPT-2-shaped "
                      "(layernorm, learned positions, gelu, tied, biases); Hugging Face export supports those two")


# --- tensors -------------------------------------------------------------------------------------
def tensors_from_hf(hf_tensors: dict[str, torch.Tensor], cfg: ModelConfig, where: str) -> dict[str, torch.Tensor]:
    """Hugging Face names and layouts -> strata's."""
    out = {}
    if _family(cfg) == "llama":
        for key, value in hf_tensors.items():
            out[_llama_name(key, where)] = value
        if cfg.tie_embeddings:
            out.pop("head.weight", None)
    else:
        prefix = "transformer." if any(k.startswith("transformer.") for k in hf_tensors) else ""
        for key, value in hf_tensors.items():
            name = key[len(prefix):] if key.startswith(prefix) else key
            if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # the tied head, and old causal-mask buffers
            if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
                block, leaf = name.split(".")[1], name.rsplit(".", 1)[1]
                parts = (value.t() if leaf == "weight" else value).chunk(3, dim=0)
                for proj, part in zip(("wq", "wk", "wv"), parts):
                    out[f"blocks.{block}.attn.{proj}.{leaf}"] = part.contiguous()
                continue
            strata_name, transpose = _gpt2_name(name, where)
            out[strata_name] = value.t().contiguous() if transpose else value
    return out


def tensors_to_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig, keys: list[str] | None) -> dict:
    """strata's names and layouts -> Hugging Face's (keys: the original file's names, to match them)."""
    out = {}
    if _family(cfg) == "llama":
        reverse = {v: k for k, v in LLAMA_LAYER.items()}
        for name, value in tensors.items():
            if name == "embed.weight":
                out["model.embed_tokens.weight"] = value
            elif name == "final_norm.weight":
                out["model.norm.weight"] = value
            elif name == "head.weight":
                out["lm_head.weight"] = value
            else:
                _, block, rest = name.split(".", 2)
                module, leaf = rest.rsplit(".", 1)
                out[f"model.layers.{block}.{reverse[module]}.{leaf}"] = value
        return out
    prefix = "transformer." if keys is None or any(k.startswith("transformer.") for k in keys) else ""
    reverse = {v: k for k, v in GPT2_LAYER.items()}
    for name, value in tensors.items():
        if name in ("embed.weight", "pos_embed.weight", "final_norm.weight", "final_norm.bias"):
            hf = {"embed": "wte", "pos_embed": "wpe", "final_norm": "ln_f"}[name.split(".")[0]]
            out[f"{prefix}{hf}.{name.rsplit('.', 1)[1]}"] = value
            continue
        _, block, rest = name.split(".", 2)
        module, leaf = rest.rsplit(".", 1)
        if module in ("attn.wq", "attn.wk", "attn.wv"):
            continue  # joined below
        transpose = leaf == "weight" and module not in ("attn_norm", "mlp_norm")
        out[f"{prefix}h.{block}.{reverse[module]}.{leaf}"] = value.t().contiguous() if transpose else value
    for block in range(cfg.n_layers):
        q, k, v = (tensors[f"blocks.{block}.attn.{p}.weight"] for p in ("wq", "wk", "wv"))
        out[f"{prefix}h.{block}.attn.c_attn.weight"] = torch.cat([q, k, v]).t().contiguous()
        out[f"{prefix}h.{block}.attn.c_attn.bias"] = torch.cat(
            [tensors[f"blocks.{block}.attn.{p}.bias"] for p in ("wq", "wk", "wv")])
    if keys is not None and "lm_head.weight" in keys:
        out["lm_head.weight"] = tensors["embed.weight"]
    return out


def _llama_name(key: str, where: str) -> str:
    fixed = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "final_norm.weight",
             "lm_head.weight": "head.weight"}
    if key in fixed:
        return fixed[key]
    parts = key.split(".")
    if key.startswith("model.layers.") and len(parts) >= 5:
        module, leaf = ".".join(parts[3:-1]), parts[-1]
        if module in LLAMA_LAYER:
            return f"blocks.{parts[2]}.{LLAMA_LAYER[module]}.{leaf}"
    raise ConfigError(f"{where}: unexpected tensor {key!r} for a LLaMA model")


def _gpt2_name(name: str, where: str) -> tuple[str, bool]:
    """(strata name, whether the weight is a Conv1D one to transpose)."""
    top = {"wte.weight": "embed.weight", "wpe.weight": "pos_embed.weight", "ln_f.weight": "final_norm.weight",
           "ln_f.bias": "final_norm.bias"}
    if name in top:
        return top[name], False
    parts = name.split(".")
    if parts[0] == "h" and len(parts) >= 4:
        module, leaf = ".".join(parts[2:-1]), parts[-1]
        if module in GPT2_LAYER:
            return f"blocks.{parts[1]}.{GPT2_LAYER[module]}.{leaf}", leaf == "weight" and not module.startswith("ln_")
    raise ConfigError(f"{where}: unexpected tensor {name!r} for a GPT-2 model")


# --- files ---------------------------------------------------------------------------------------
def read_hf_config(directory: str) -> dict:
    config_file = os.path.join(directory, "config.json")
    if not os.path.isfile(config_file):
        raise ConfigError(f"--from-hf {directory}: no config.json there")
    return read_json(config_file, "a Hugging Face config.json")


def read_hf_tensors(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of a local Hugging Face model directory (safetensors, one file or sharded)."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        files = _index_files(index, directory)
    elif os.path.isfile(os.path.join(directory, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ConfigError(f"--from-hf {directory}: no model.safetensors (or its index); only safetensors "
                          f"checkpoints are read (save with safe_serialization=True)")
    tensors = {}
    for name in files:
        try:
            tensors.update(load_file(os.path.join(directory, name)))
        except (SafetensorError, OSError) as e:
            raise CorruptError(f"--from-hf {directory}: {name} is not a readable safetensors file ({e})") from None
    return tensors


def _index_files(index: str, directory: str) -> list[str]:
    """The shard files a model.safetensors.index.json names: plain names inside the directory."""
    weight_map = read_json_object(index, "an index of safetensors files").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CorruptError(f"{index}: 'weight_map' must map tensor names to file names")
    return sorted({os.path.basename(inside(directory, name, index)) for name in weight_map.values()})


def convert_from_hf(directory: str, out: str) -> str:
    """A Hugging Face model directory -> a strata checkpoint (step 0, no optimizer state) that
    `strata train --init-from` starts from under any layout, and `strata generate` reads."""
    check_output_dir(out, "out")
    if os.path.isdir(out) and os.listdir(out):  # a save directory's `latest` would move to step 0
        raise ConfigError("holds files already; convert into a new or empty directory", "out", out)
    hf_config = read_hf_config(directory)
    cfg = model_config_from_hf(hf_config, f"--from-hf {directory}")
    tokenizer = _hf_tokenizer(directory)
    hf_tensors = read_hf_tensors(directory)
    tensors = tensors_from_hf(hf_tensors, cfg, f"--from-hf {directory}")
    expected = _expected_shapes(cfg)
    if set(tensors) != set(expected):
        raise ConfigError(f"--from-hf {directory}: tensors do not match the config (missing "
                          f"{sorted(set(expected) - set(tensors))[:3]}, unexpected {sorted(set(tensors) - set(expected))[:3]})")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ConfigError(f"--from-hf {directory}: {name} has shape {list(tensors[name].shape)}, "
                              f"the config implies {list(shape)}")
    pieces = [shards.LocalPiece(name, shards.Region.whole(t.shape), t, True) for name, t in sorted(tensors.items())]
    data, meta = shards.snapshot(pieces, None)
    dtype = str(next(iter(hf_tensors.values())).dtype).removeprefix("torch.")
    state = {"model_config": cfg.to_dict(), "config": {"dtype": "fp32"},
             "layout": {"dp": 1, "tp": 1, "pp": 1, "zero": 0},
             "hf": {"config": hf_config, "keys": sorted(hf_tensors), "dtype": dtype, "source": os.path.abspath(directory)}}
    return store.Checkpointer(out, 0, 1).save(0, data, meta, state, (tokenizer,) if tokenizer else ())


def _hf_tokenizer(directory: str) -> str | None:
    """The model's tokenizer.json, if it has one that loads (it travels into the checkpoint)."""
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.lexists(path):
        return None
    try:
        Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception for a bad file
        raise CorruptError(f"--from-hf {directory}: tokenizer.json is not a tokenizer that `tokenizers` reads "
                           f"({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})") from None
    return path


def convert_to_hf(checkpoint: str, out: str) -> str:
    """A strata checkpoint (any layout) -> a Hugging Face model directory that `transformers`
    loads with from_pretrained."""
    check_output_dir(out, "out")
    clash = [n for n in HF_FILES if os.path.exists(os.path.join(out, n))]
    if clash:
        raise ConfigError(f"holds a model already ({clash[0]}); convert into a new directory", "out", out)
    path, manifest, reader = store.open_checkpoint(checkpoint)
    cfg = store.model_config(manifest, path)
    with reader:
        tensors = shards.read_full(reader)
    return save_hf(tensors, cfg, out, manifest.get("hf", {}), store.verified_file(path, "tokenizer.json"))


def save_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig, out: str, original: dict | None = None,
            tokenizer: str | None = None) -> str:
    """Write strata's logical tensors as a Hugging Face model directory (original: what a
    conversion from Hugging Face recorded: its config, tensor names and dtype)."""
    original = original or {}
    hf_tensors = tensors_to_hf(tensors, cfg, original.get("keys"))
    if "dtype" in original:  # the dtype the model came in
        hf_tensors = {k: v.to(getattr(torch, original["dtype"])) for k, v in hf_tensors.items()}
    os.makedirs(out, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in hf_tensors.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config_from_model(cfg, original.get("config")), f, indent=2)
    if tokenizer is not None:
        shutil.copy(tokenizer, out)
    return out


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in build_model(cfg, seed=None).named_parameters()}
