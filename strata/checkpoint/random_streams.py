"""Each process's random streams (torch, numpy, Python's, CUDA's), as the JSON a checkpoint's rank file keeps
(strata/checkpoint/shards.py), and checked and restored from it."""

from __future__ import annotations

import random

import numpy as np
import torch

from strata.checkpoint.records import whole


def rng_state() -> dict:
    """Every random stream of this process, as JSON."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state().tolist(), "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
             "python": [version, list(internal), gauss_next]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def rng_problem(state: object) -> str | None:
    """Why `state` (a shard's record of a rank's random streams) cannot be restored, or None: each
    stream is set on a scratch generator of its kind, so nothing of this process changes."""
    if not isinstance(state, dict) or not {"torch", "numpy", "python"} <= set(state):
        return "want the torch, numpy and python streams"
    try:
        for name in ("torch", "cuda"):
            if name in state:
                values = state[name]
                if not isinstance(values, list) or not all(whole(v) and v < 256 for v in values):
                    return f"{name}: want a list of bytes"
        torch.Generator().set_state(torch.tensor(state["torch"], dtype=torch.uint8))
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.RandomState().set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
        version, internal, gauss_next = state["python"]
        random.Random().setstate((version, tuple(internal), gauss_next))
    except (TypeError, ValueError, RuntimeError, OverflowError, IndexError, KeyError) as e:  # each library's complaint
        return str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    return None
