"""ParallelDims: the one source of truth for which rank holds which slice of the work.

Rank order (row-major over (pp, dp, tp)): tp innermost, so a tensor-parallel group is a run of
adjacent ranks and stays inside one node on a real cluster; dp next; pp outermost, so pipeline
stages are the groups that cross nodes. Process groups come from `init_device_mesh` and are passed
to whoever needs them; no module builds its own."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's position on each dimension."""
        return {"pp": rank // (self.dp * self.tp), "dp": rank // self.tp % self.dp, "tp": rank % self.tp}

    def rank_at(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The named mesh ("pp", "dp", "tp"); None for a single process (no process group)."""
        if self.world_size == 1:
            return None
        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))


def pick_device(choice: str = "auto") -> torch.device:
    """cuda (one device per local rank) when asked for or available, else cpu."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout_s: float) -> tuple[int, int, bool]:
    """Join the process group torchrun set up (NCCL on CUDA, gloo on CPU) with a timeout on every
    collective. Returns (rank, world_size, created): (0, 1, False) when not launched by torchrun;
    created is False when the caller had initialised the group already (and will tear it down)."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size == 1:
        return 0, 1, False
    created = not dist.is_initialized()
    if created:
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        # After a restart (--max-restarts) torchrun's store still holds the dead attempt's keys,
        # among them the peers' old addresses, which a new rank may read before they are
        # rewritten: each attempt gets keys of its own.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"strata/attempt_{attempt}", store), rank=rank,
                                world_size=world_size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    return dist.get_rank(), dist.get_world_size(), created


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))
