"""The damaged files tests/test_bad_input.py points its commands at, built once per module: a
prepared data directory and a checkpoint, copies of them broken in the ways a disk, a truncated
copy or an attacker breaks them, Hugging Face configs and planner configs that lie, and files of
the wrong kind. `bad_input_files(root)` returns their paths by group and name."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import torch
from safetensors.torch import save_file

from strata.checkpoint import shards, store
from strata.config import train_config
from strata.data.prepare import prepare
from strata.train.trainer import train

CORPUS = "It was the best of times, it was the worst of times, it was the age of wisdom.\n" * 200
LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32}
GPT2 = {"model_type": "gpt2", "vocab_size": 64, "n_embd": 16, "n_layer": 2, "n_head": 2, "n_positions": 32}


def _json(path, obj) -> str:
    with open(path, "w") as f:
        f.write(obj if isinstance(obj, str) else json.dumps(obj))
    return str(path)


def _data(root) -> dict[str, str]:
    """A prepared data directory and broken copies of it."""
    (root / "corpus.txt").write_text(CORPUS)
    good = root / "data"
    prepare([str(root / "corpus.txt")], str(good), "bpe:300", 0.1)
    shard = "train_000.bin"
    dirs = {"good": str(good), "corpus": str(root / "corpus.txt"), "short_val": str(root / "data_short_val")}
    prepare([str(root / "corpus.txt")], dirs["short_val"], str(good / "tokenizer.json"), 0.002)

    def broken(name, damage):
        copy = root / f"data_{name}"
        shutil.copytree(good, copy)
        damage(copy)
        dirs[name] = str(copy)

    def truncate(copy, size):
        with open(copy / shard, "r+b") as f:
            f.truncate(size)

    def meta(copy, change):
        m = json.loads((copy / "meta.json").read_text())
        change(m)
        (copy / "meta.json").write_text(json.dumps(m))

    broken("truncated", lambda c: truncate(c, os.path.getsize(c / shard) - 2))
    broken("odd", lambda c: truncate(c, os.path.getsize(c / shard) - 1))
    broken("empty_shard", lambda c: truncate(c, 0))
    broken("missing_shard", lambda c: os.remove(c / shard))
    broken("big_ids", lambda c: np.memmap(c / shard, dtype=np.uint16, mode="r+").__setitem__(5, 65000))
    broken("meta_not_json", lambda c: (c / "meta.json").write_text("{not json"))
    broken("meta_array", lambda c: (c / "meta.json").write_text("[1, 2]"))
    broken("meta_escape", lambda c: meta(c, lambda m: m["splits"]["train"]["shards"][0].update(file="../../etc/passwd")))
    broken("meta_no_vocab", lambda c: meta(c, lambda m: m.pop("vocab_size")))
    return dirs


def _checkpoints(root, data_dir) -> dict[str, str]:
    """A checkpoint of a tiny run on prepared data (with its tokenizer), and broken copies."""
    save = root / "ck"
    train(train_config(model="tiny", data=data_dir, seq_len=16, steps=2, micro_batch=2, save=str(save),
                      progress=False, eval_batches=1, peak_flops=1e10))
    step = save / "step_000002"
    found = {"save": str(save), "good": str(step)}

    def broken(name, damage):
        copy = root / f"ck_{name}"
        shutil.copytree(save, copy)
        damage(copy / "step_000002")
        found[name] = str(copy / "step_000002")

    def manifest(ckpt, change):
        m = json.loads((ckpt / "manifest.json").read_text())
        change(m)
        (ckpt / "manifest.json").write_text(json.dumps(m))

    def rename_shard(ckpt):
        manifest(ckpt, lambda m: m["files"].update({"shard_../../x.json": m["files"].pop("shard_0.json")}))

    def tamper_tokenizer(ckpt):  # the same size, other bytes
        text = (ckpt / "tokenizer.json").read_bytes()
        (ckpt / "tokenizer.json").write_bytes(text.replace(b"the", b"THE", 1) if b"the" in text else text[::-1])

    def rewrite(ckpt, name, change):  # a damaged file, and a manifest that agrees with it
        data = change(bytearray((ckpt / name).read_bytes()))
        (ckpt / name).write_bytes(bytes(data))
        manifest(ckpt, lambda m: m["files"][name].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest()))

    def header_length(data, length):
        data[:8] = length.to_bytes(8, "little")
        return data

    def flip_last_byte(data):  # the same size, other bytes; the manifest not told
        data[-1] ^= 0xFF
        return data

    def link_out(ckpt, name):  # the file replaced by a link to an identical copy outside the checkpoint
        outside = root / f"outside_{name}_{len(found)}"
        shutil.copy(ckpt / name, outside)
        os.remove(ckpt / name)
        os.symlink(outside, ckpt / name)

    broken("copy", lambda c: None)  # intact, in a save directory of its own
    broken("shard_truncated", lambda c: rewrite(c, "shard_0.safetensors", lambda d: d[:len(d) // 2]))
    broken("shard_header_length", lambda c: rewrite(c, "shard_0.safetensors", lambda d: header_length(d, 10 ** 15)))
    broken("shard_wrong_sha", lambda c: (c / "shard_0.safetensors").write_bytes(
        bytes(flip_last_byte(bytearray((c / "shard_0.safetensors").read_bytes())))))
    broken("tokenizer_link", lambda c: link_out(c, "tokenizer.json"))
    broken("shard_link", lambda c: link_out(c, "shard_0.safetensors"))
    broken("manifest_not_json", lambda c: (c / "manifest.json").write_text("{"))
    broken("manifest_array", lambda c: (c / "manifest.json").write_text("[]"))
    broken("manifest_no_model", lambda c: manifest(c, lambda m: m.pop("model_config")))
    broken("huge_width", lambda c: manifest(c, lambda m: m["model_config"].update(d_model=10 ** 12)))
    broken("manifest_escape", lambda c: manifest(c, lambda m: m["files"].update({"../../outside/x": {"bytes": 1,
                                                                                   "sha256": "0" * 64}})))
    broken("shard_escape", rename_shard)
    broken("tokenizer_tampered", tamper_tokenizer)
    escape = root / "ck_latest_escape"
    shutil.copytree(save, escape)
    (escape / "latest").write_text("../other/step_000005")
    found["latest_escape"] = str(escape)
    latest_link = root / "ck_latest_link"  # `latest` names a step directory that is a link to another run's
    shutil.copytree(save, latest_link)
    shutil.copytree(step, root / "other_run" / "step_000009")
    os.symlink(root / "other_run" / "step_000009", latest_link / "step_000009")
    (latest_link / "latest").write_text("step_000009")
    found["latest_link"] = str(latest_link)
    converted = root / "ck_converted"  # weights only, as `convert --from-hf` writes them: nothing to --resume
    _, state, reader = store.open_checkpoint(str(step))
    with reader:
        weights = shards.read_full(reader)
    pieces = [shards.LocalPiece(name, shards.Region.whole(t.shape), t, True) for name, t in sorted(weights.items())]
    store.Checkpointer(str(converted), 0, 1).save(0, *shards.snapshot(pieces, None),
                                                  {"model_config": state["model_config"], "config": {"dtype": "fp32"}})
    found["weights_only"] = str(converted / "step_000000")
    return found


def _hf(root) -> dict[str, str]:
    """Hugging Face model directories, each wrong in one way."""
    found = {}

    def model_dir(name, config, index=None):
        d = root / f"hf_{name}"
        d.mkdir()
        _json(d / "config.json", config)
        save_file({"model.embed_tokens.weight": torch.zeros(64, 16)}, str(d / "model-00001.safetensors"))
        if index is not None:
            _json(d / "model.safetensors.index.json", index)
        found[name] = str(d)

    model_dir("index_not_json", LLAMA, "{nope")
    model_dir("index_no_map", LLAMA, {"metadata": {}})
    model_dir("index_list_map", LLAMA, {"weight_map": ["model-00001.safetensors"]})
    model_dir("index_escape", LLAMA, {"weight_map": {"model.embed_tokens.weight": "../../secret.safetensors"}})
    model_dir("config_list", [LLAMA])
    model_dir("config_missing_heads", {k: v for k, v in LLAMA.items() if k != "num_attention_heads"})
    model_dir("config_zero_heads", {**LLAMA, "num_attention_heads": 0})
    model_dir("config_string_layers", {**LLAMA, "num_hidden_layers": "1"})
    model_dir("config_unknown_type", {**LLAMA, "model_type": "mamba"})
    # Phi-3's older config.json files carry the factor at the top level, not in rope_scaling
    model_dir("config_partial_rope", {**LLAMA, "model_type": "phi3", "partial_rotary_factor": 0.5})
    model_dir("bad_tokenizer", LLAMA)
    (root / "hf_bad_tokenizer" / "tokenizer.json").write_text('{"model": "none"}')
    return found


def _planner_configs(root) -> dict[str, str]:
    configs = {"array": [GPT2], "no_heads": {k: v for k, v in GPT2.items() if k != "n_head"},
               "zero_heads": {**GPT2, "n_head": 0}, "string_layers": {**GPT2, "n_layer": "96"},
               "no_ffn": {k: v for k, v in LLAMA.items() if k != "intermediate_size"},
               "zero_layers": {**GPT2, "n_layer": 0}, "huge_layers": {**LLAMA, "num_hidden_layers": 10 ** 9}}
    return {name: _json(root / f"plan_{name}.json", c) for name, c in configs.items()}


def _files(root) -> dict[str, str]:
    (root / "src_dirs" / "sub.txt").mkdir(parents=True)  # a directory that only looks like a text file
    (root / "src_broken").mkdir()
    os.symlink(root / "gone.txt", root / "src_broken" / "broken.txt")
    (root / "hosts_binary").write_bytes(b"\x8c\xff\x00 slots=1")
    (root / "hosts_lo").write_text("127.0.0.1 slots=2\n")
    (root / "no_loss.jsonl").write_text('{"kind": "train", "step": 1}\n')
    (root / "empty_trace.json").write_text('{"traceEvents": []}')
    (root / "not_json.json").write_text("{oops")
    (root / "binary.txt").write_bytes(bytes(range(256)) * 4)
    (root / "empty.txt").write_text("")
    (root / "a_file").write_text("x")
    (root / "bad_tokenizer.json").write_text('{"model": 42}')
    (root / "binary.toml").write_bytes(b"\x00\xff\xfe garbage \x89PNG")
    (root / "a_dir").mkdir()
    (root / "both_spellings.toml").write_text("seq-len = 16\nseq_len = 32\n")
    return {name: str(root / name) for name in
            ("binary.txt", "empty.txt", "a_file", "bad_tokenizer.json", "binary.toml", "a_dir", "src_dirs", "src_broken",
             "hosts_binary", "hosts_lo", "no_loss.jsonl", "empty_trace.json", "not_json.json",
             "both_spellings.toml")}


def bad_input_files(root) -> dict:
    data = _data(root)
    return {"root": str(root), "data": data, "ck": _checkpoints(root, data["good"]), "hf": _hf(root),
            "plan": _planner_configs(root), "file": _files(root)}
