"""`strata generate`: load a checkpoint, encode the prompt, stream the sampled text."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from strata.checkpoint import store
from strata.checkpoint.shards import read_full
from strata.config import ConfigError, check_tensor_parallel
from strata.infer.generate import generate
from strata.model.config import ModelConfig
from strata.model.transformer import build_model
from strata.parallel.tensor import apply_tensor_parallel, shard_specs, slice_tensor_parallel


def load_for_inference(checkpoint: str, device="cpu", tp_group=None):
    """(model, tokenizer or None) from a checkpoint directory or a save directory; with a tp
    group, the model split across its ranks (tensor-parallel inference)."""
    if not os.path.isdir(checkpoint):
        raise ConfigError(f"--checkpoint {checkpoint}: no such directory")
    path, state, reader = store.open_checkpoint(checkpoint)
    model_cfg = ModelConfig.from_dict(state["model_config"])
    dtype = torch.float64 if state["config"]["dtype"] == "fp64" else torch.float32
    model = build_model(model_cfg, seed=None)
    if tp_group is not None:
        check_tensor_parallel(model_cfg, dist.get_world_size(tp_group))
        apply_tensor_parallel(model, tp_group)
    model = model.to_empty(device=device).to(dtype)
    with reader:
        tensors = read_full(reader)
    if tp_group is not None:
        tensors = slice_tensor_parallel(tensors, shard_specs(model), tp_group)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ConfigError(f"checkpoint {path}: does not match its model config "
                          f"(missing {list(missing)[:3]}, unexpected {list(unexpected)[:3]})")
    model.reset_buffers()
    tokenizer = None
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if os.path.isfile(tokenizer_file):
        from strata.data.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(tokenizer_file)
    return model, tokenizer


def run_generate(args, argv: list[str]) -> int:
    """Generate on one process, or on --tp N processes (launched here unless torchrun did)."""
    if args.tp < 1:
        raise ConfigError(f"--tp {args.tp}: must be >= 1")
    launched = "LOCAL_RANK" in os.environ
    if args.tp > 1 and not launched:
        if not os.path.isdir(args.checkpoint):
            raise ConfigError(f"--checkpoint {args.checkpoint}: no such directory")
        check_tensor_parallel(ModelConfig.from_dict(store.read_state(args.checkpoint)["model_config"]), args.tp)
        from strata.distributed.launch import launch_local
        return launch_local(args.tp, argv)
    tp_group, rank = None, 0
    if launched and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        from strata.distributed.mesh import ParallelDims, init_distributed, pick_device
        _, world, _ = init_distributed(pick_device("cpu"), timeout_s=300)
        if world != args.tp:
            raise ConfigError(f"--tp {args.tp}: launched with {world} processes; they must be equal")
        tp_group = ParallelDims(tp=world).build_mesh("cpu")["tp"].get_group()
        rank = dist.get_rank()
    try:
        return _generate(args, tp_group, rank)
    finally:
        if tp_group is not None:
            dist.destroy_process_group()


def _generate(args, tp_group, rank: int) -> int:
    for name in ("max_new_tokens", "top_k"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: must be >= 1")
    if args.temperature < 0:
        raise ConfigError(f"--temperature {args.temperature}: must be >= 0 (0 is greedy)")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p {args.top_p}: must be in (0, 1]")
    model, tokenizer = load_for_inference(args.checkpoint, tp_group=tp_group)
    if args.prompt is not None:
        if tokenizer is None:
            raise ConfigError(f"--prompt: checkpoint {args.checkpoint} has no tokenizer.json "
                              f"(trained on synthetic data); use --prompt-ids 1,2,3")
        ids = tokenizer.encode(args.prompt).ids
    else:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--prompt-ids {args.prompt_ids}: want comma-separated integers") from None
    vocab = model.cfg.vocab_size
    if not ids or any(not 0 <= i < vocab for i in ids):
        raise ConfigError(f"prompt ids {ids[:8]}: want at least one id, each in [0, {vocab})")

    out = sys.stdout if rank == 0 else open(os.devnull, "w")  # every rank computes, rank 0 prints
    out.write(args.prompt if args.prompt is not None else " ".join(map(str, ids)))
    generated: list[int] = []
    printed = ""
    for next_ids in generate(model, torch.tensor([ids]), args.max_new_tokens, args.temperature,
                             args.top_k, args.top_p, args.seed):
        generated.append(int(next_ids[0]))
        if tokenizer is None:
            out.write(f" {generated[-1]}")
        else:  # decode the whole answer each time: a multi-byte character may span tokens
            text = tokenizer.decode(generated)
            if not text.endswith("\ufffd"):
                out.write(text[len(printed):])
                printed = text
        out.flush()
    out.write("\n")
    return 0
