"""Hugging Face interop: `strata convert --from-hf DIR --out CKPT` and `strata convert --to-hf CKPT
--out DIR` (config.json + safetensors, no hub access), for every family described in
strata/model/families (Llama 2/3/3.1, Qwen2/2.5, Qwen3, Mistral, Gemma, Phi-3, GPT-2, BLOOM).

This file reads and writes the files; the family of a config.json's `model_type` (or of the
model's `family`, when exporting) knows its keys, its tensor names and their layouts. Tensors keep
the dtype they came in (fp32 training loads them as fp32 masters), and the original config.json
travels inside the checkpoint: converting back gives the same tensors, bit for bit, under the
same names, and the same config with the shape fields taken from the model."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import fields

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from strata.checkpoint import shards, store
from strata.data.tokenizer import read_tokenizer
from strata.errors import ConfigError, CorruptError
from strata.files import check_output_dir, inside, read_json, read_json_object
from strata.model.config import ModelConfig
from strata.model.families import converting_family, family_of_model_type
from strata.model.transformer import build_model, tensor_shapes

HF_FILES = ("config.json", "model.safetensors", "tokenizer.json")  # what --to-hf writes
# Small files transformers reads beside the model (AutoTokenizer's special tokens and chat template,
# generate()'s defaults): kept in the checkpoint's record of its origin, written back by --to-hf.
HF_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
# the config.json keys that count things (a present one must be a whole number >= 1)
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings", "head_dim", "n_embd", "n_layer", "n_head",
              "n_positions", "n_inner", "sliding_window", "seq_length")


# --- configs -------------------------------------------------------------------------------------
def model_config_from_hf(hf: dict, where: str) -> ModelConfig:
    """The model a Hugging Face config.json describes; one line naming the key when it cannot."""
    if not isinstance(hf, dict):
        raise ConfigError(f"{where}: config.json holds a JSON {type(hf).__name__}, not an object")
    for key in SHAPE_KEYS:
        value = hf.get(key)
        if key == "sliding_window" and value == 0 and hf.get("use_sliding_window") is False:
            continue  # transformers 5's Qwen2MoeConfig writes 0 for a window that is off
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{where}: config.json: {key}={value!r} must be a whole number >= 1")
    family = family_of_model_type(hf.get("model_type"), where)
    try:
        cfg = family.config_from_hf(hf, where)
        cfg.validate()
    except KeyError as e:
        raise ConfigError(f"{where}: config.json has no {e.args[0]!r}") from None
    except ConfigError:
        raise
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
        raise ConfigError(f"{where}: config.json does not describe a valid model ({e})") from None
    return cfg


def hf_config_from_model(cfg: ModelConfig, original: dict | None) -> dict:
    """config.json for a strata model: the original one with the shape fields set from the model.
    Refused when the family's config.json cannot say what the model computes (read back, it would
    describe another model)."""
    family = converting_family(cfg)
    try:
        hf = family.config_to_hf(cfg, dict(original or {}))
        described = family.config_from_hf(hf, "export")
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as e:  # a recorded config.json
        raise CorruptError(f"the config.json recorded with the model cannot describe it ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''})") from None
    # d_head and n_kv_heads may be None or the value they default to: compare what they mean
    names = [f.name for f in fields(ModelConfig) if f.name not in ("d_head", "n_kv_heads")] + ["head_dim", "kv_heads"]
    differing = [name for name in names if getattr(described, name) != getattr(cfg, name)]
    if differing:
        name = differing[0]
        raise ConfigError(f"a {family.name} config.json cannot hold this model's {name}={getattr(cfg, name)!r} "
                          f"(it would read back as {getattr(described, name)!r})")
    return hf


# --- tensors -------------------------------------------------------------------------------------
def tensors_from_hf(hf_tensors: dict[str, torch.Tensor], cfg: ModelConfig, where: str) -> dict[str, torch.Tensor]:
    """Hugging Face names and layouts -> strata's."""
    return converting_family(cfg).tensors_from_hf(hf_tensors, cfg, where)


def tensors_to_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig, keys: list[str] | None) -> dict:
    """strata's names and layouts -> Hugging Face's (keys: the original file's names, to match them)."""
    return converting_family(cfg).tensors_to_hf(tensors, cfg, keys)


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
    # links_out: a Hugging Face hub snapshot's files are links into the cache's blobs/ directory
    return sorted({os.path.basename(inside(directory, name, index, links_out=True)) for name in weight_map.values()})


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
             "hf": {"config": hf_config, "keys": sorted(hf_tensors), "dtype": dtype, "source": os.path.abspath(directory),
                    "side_files": _side_files(directory)}}
    return store.Checkpointer(out, 0, 1).save(0, data, meta, state, (tokenizer,) if tokenizer else ())


def _side_files(directory: str) -> dict[str, dict]:
    """HF_SIDE_FILES the directory has, each a JSON object."""
    found = {}
    for name in HF_SIDE_FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            found[name] = read_json_object(path, f"Hugging Face's {name}")
    return found


def _hf_tokenizer(directory: str) -> str | None:
    """The model's tokenizer.json, if it has one that loads (it travels into the checkpoint)."""
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.lexists(path):
        return None
    read_tokenizer(path, f"--from-hf {directory}", CorruptError)
    return path


def convert_to_hf(checkpoint: str, out: str) -> str:
    """A strata checkpoint (any layout) -> a Hugging Face model directory that `transformers`
    loads with from_pretrained."""
    check_output_dir(out, "out")
    clash = [n for n in HF_FILES + HF_SIDE_FILES if os.path.exists(os.path.join(out, n))]
    if clash:
        raise ConfigError(f"holds a model already ({clash[0]}); convert into a new directory", "out", out)
    path, manifest, reader = store.open_checkpoint(checkpoint)
    with reader:
        cfg = store.checked_model_config(path, manifest, reader)
        tensors = shards.read_full(reader)
    return save_hf(tensors, cfg, out, manifest.get("hf", {}), store.verified_file(path, "tokenizer.json"))


def save_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig, out: str, original: dict | None = None,
            tokenizer: str | None = None) -> str:
    """Write strata's logical tensors as a Hugging Face model directory (original: what a
    conversion from Hugging Face recorded: its config, tensor names and dtype)."""
    original = original or {}
    hf_config = hf_config_from_model(cfg, original.get("config"))  # refused before a file is written
    hf_tensors = tensors_to_hf(tensors, cfg, original.get("keys"))
    if "dtype" in original:  # the dtype the model came in
        hf_tensors = {k: v.to(getattr(torch, original["dtype"])) for k, v in hf_tensors.items()}
    os.makedirs(out, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in hf_tensors.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    written = {"config.json": hf_config, **(original.get("side_files") or {})}
    for name, content in written.items():
        if name in ("config.json", *HF_SIDE_FILES):  # names of our own: a manifest is data, not a path
            with open(os.path.join(out, name), "w") as f:
                json.dump(content, f, indent=2)
    if tokenizer is not None:
        shutil.copy(tokenizer, out)
    return out


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return tensor_shapes(build_model(cfg, seed=None))
