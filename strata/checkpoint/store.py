"""Saving and resuming a run.

A checkpoint is a directory `step_NNNNNN` under the save directory:
  model.safetensors   the model's full parameters (gathered, written by rank 0)
  optimizer.pt        the optimizer's state_dict (replicated layouts: rank 0's), or
  optimizer_<rank>.pt one per rank when ZeRO, tensor or pipeline parallelism splits the optimizer states;
                      these load only under the same layout (resharding comes with layout-free
                      checkpoints)
  rng_<rank>.pt       every random stream of every rank (torch, numpy, python)
  state.json          step, train config, model config
It is written to `step_NNNNNN.tmp` and renamed into place only when complete (all ranks finished),
then `latest` is rewritten to name it: a save killed midway is never picked up."""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from strata.config import ConfigError
from strata.distributed import comm


def step_dir(save_dir: str, step: int) -> str:
    return os.path.join(save_dir, f"step_{step:06d}")


def optimizer_is_split(layout: dict) -> bool:
    return layout["zero"] > 0 or layout["tp"] > 1 or layout.get("pp", 1) > 1


def save(save_dir: str, step: int, model_state: dict, optimizer, state: dict, rank: int, world_size: int,
         layout: dict, extra_files: tuple[str, ...] = ()) -> str:
    """Write checkpoint `step` under save_dir (every rank calls this); extra_files (such as the
    tokenizer) are copied in, so the checkpoint alone is enough to generate from."""
    final = step_dir(save_dir, step)
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier(world_size)
    torch.save(_rng_state(), os.path.join(tmp, f"rng_{rank}.pt"))
    if optimizer_is_split(layout):
        torch.save(optimizer.state_dict(), os.path.join(tmp, f"optimizer_{rank}.pt"))
    if rank == 0:
        save_file({k: v.contiguous().cpu() for k, v in model_state.items()}, os.path.join(tmp, "model.safetensors"))
        if not optimizer_is_split(layout):
            torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
        for path in extra_files:
            shutil.copy(path, tmp)
        with open(os.path.join(tmp, "state.json"), "w") as f:
            json.dump({"step": step, "world_size": world_size, "layout": layout, **state}, f, indent=2)
    _barrier(world_size)
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with open(os.path.join(save_dir, "latest.tmp"), "w") as f:
            f.write(os.path.basename(final))
        os.replace(os.path.join(save_dir, "latest.tmp"), os.path.join(save_dir, "latest"))
    _barrier(world_size)
    return final


def resolve(path: str) -> str:
    """A checkpoint directory, or a save directory whose `latest` names one."""
    if os.path.isfile(os.path.join(path, "state.json")):
        return path
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            return os.path.join(path, f.read().strip())
    raise ConfigError(f"--resume {path}: not a checkpoint (no state.json) and no 'latest' in it")


def read_state(path: str) -> dict:
    with open(os.path.join(resolve(path), "state.json")) as f:
        return json.load(f)


def read_model(path: str, device) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(resolve(path), "model.safetensors"), device=str(device))


def check_model_keys(path: str, result) -> None:
    missing, unexpected = result
    if missing or unexpected:
        raise ConfigError(f"checkpoint {path}: does not match the model "
                          f"(missing {list(missing)[:3]}, unexpected {list(unexpected)[:3]})")


def load(path: str, optimizer, device, rank: int, layout: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """Restore the optimizer and this rank's random streams; returns (state.json, the full model
    tensors) for the caller to place into its layout."""
    path = resolve(path)
    state = read_state(path)
    saved = state.get("layout", {"dp": 1, "tp": 1, "pp": 1, "zero": 0})
    if (optimizer_is_split(saved) or optimizer_is_split(layout)) and saved != layout:
        raise ConfigError(f"--resume {path}: saved with layout {saved}, now {layout}; split "
                          f"optimizer states (ZeRO, tensor or pipeline parallel) load only under the layout that saved them")
    name = f"optimizer_{rank}.pt" if optimizer_is_split(layout) else "optimizer.pt"
    optimizer.load_state_dict(torch.load(os.path.join(path, name), map_location=device, weights_only=True))
    rng_file = os.path.join(path, f"rng_{rank}.pt")
    if os.path.isfile(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return state, read_model(path, device)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _barrier(world_size: int) -> None:
    if world_size > 1:
        comm.barrier()
