"""parallelize(): build the model for this rank's place in the layout and wrap it.

The order is fixed (torchtitan's, and the only one that composes): tensor parallelism swaps layers,
pipeline parallelism keeps this rank's stage, data parallelism / ZeRO wraps what is left. Only the
last exists so far."""

from __future__ import annotations

import torch

from strata.config import TrainConfig
from strata.model.config import ModelConfig
from strata.model.transformer import Transformer, build_model, initial_value
from strata.parallel.data import DataParallel
from strata.parallel.zero import ZeroDataParallel
from strata.parallel.zero3 import FullyShardedDataParallel


def parallelize(model_cfg: ModelConfig, cfg: TrainConfig, device: torch.device, dtype: torch.dtype,
                dp_group) -> tuple[Transformer, DataParallel]:
    if cfg.zero == 3:
        # Built on the meta device and materialised one unit at a time, shard by shard: the full
        # model never exists on one rank.
        model = build_model(model_cfg, seed=None)
        init = lambda name, shape: initial_value(name, shape, cfg.seed, model_cfg.n_layers).to(device, dtype)  # noqa: E731
        wrapper = FullyShardedDataParallel(model, dp_group, init, device, dtype)
        model.reset_buffers()
        return model, wrapper
    model = build_model(model_cfg, device, dtype, cfg.seed)
    if cfg.zero == 0:
        return model, DataParallel(model, dp_group, cfg.bucket_mb)
    return model, ZeroDataParallel(model, dp_group, cfg.zero, cfg.bucket_mb)
