"""AdamW with decoupled weight decay on the matrices only, and a warm-up + cosine schedule."""

from __future__ import annotations

import math
import os
import tempfile

import torch

from strata.config import TrainConfig
from strata.memory.offload import DiskMoments, HostOffloadAdamW, MemoryMoments, StreamingAdamW
from strata.parallel.onebit_adam import OnebitAdam


def build_optimizer(decay: list[torch.Tensor], no_decay: list[torch.Tensor], cfg: TrainConfig, rank: int = 0,
                    stream=None, sharding=None):
    """AdamW over the tensors this rank updates (whole parameters, or its ZeRO shards of them).
    Weight decay applies to what comes from matrices and embeddings, not to norms or biases, as in
    GPT-3 and LLaMA training. --offload cpu runs it in host memory, --offload disk keeps its moments
    in a file (the same arithmetic either way). stream: with --offload-params, ZeRO-3's pass over
    its offloaded shards, a unit at a time (strata/parallel/zero3.py `stream_units`). sharding: the
    data-parallel strategy, whose compressed average --compress onebit's and zeroone's optimizer
    calls (strata/parallel/onebit_adam.py)."""
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    betas = (cfg.beta1, cfg.beta2)
    if cfg.layout.compress in ("onebit", "zeroone"):
        return OnebitAdam(groups, cfg.lr, betas, sharding)
    if cfg.layout.offload == "disk":
        return StreamingAdamW(groups, cfg.lr, betas, DiskMoments(offload_dir(cfg), rank), stream=stream)
    if stream is not None:
        return StreamingAdamW(groups, cfg.lr, betas, MemoryMoments(host=cfg.layout.offload == "cpu"), stream=stream)
    if cfg.layout.offload == "cpu":
        return HostOffloadAdamW(groups, cfg.lr, betas)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, fused=True)


def offload_dir(cfg: TrainConfig) -> str:
    """Where offloaded files go: --offload-dir, or the temp directory."""
    return cfg.offload_dir or os.path.join(tempfile.gettempdir(), "strata-offload")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up over warmup_steps, then a
    cosine from lr down to min_lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
