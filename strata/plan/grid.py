"""2-D, 2.5-D and 3-D tensor parallelism's communication for the cost model: the bytes are
strata/rules/tensor_modes.py's (the same count the runtime's collectives are tested against, sub-
group by sub-group), each sub-group's collectives timed on the link that group crosses."""

from __future__ import annotations

from typing import Callable

from strata.model.config import ModelConfig
from strata.rules.layout import Layout
from strata.rules.tensor_modes import (
    ElementBytes,
    GridTraffic,
    TensorGrid,
    block_bytes,
    forward_block_bytes,
    group_shape,
    micro_batch_bytes,
)


def grid_terms(cfg: ModelConfig, grid: TensorGrid, tokens: int, act_bytes: int, param_bytes: int,
               recompute: bool, seconds: Callable[[int, int, float], float]) -> dict:
    """The cost model's tensor-parallel terms for one micro-batch of `tokens` tokens: bytes and
    seconds of one block (its forward again under full recomputation) and of the rest (embedding,
    head, loss). `seconds(size, stride, nbytes)`: one collective's time on a group of `size` ranks
    `stride` apart moving `nbytes` in all (as an all-gather of that output)."""
    # blocks in the activations' dtype, statistics and the loss's sums in fp32 or wider
    e = ElementBytes(act_bytes, max(act_bytes, 4), param_bytes)
    whole = micro_batch_bytes(cfg, grid, tokens, e)
    block, again = GridTraffic(), GridTraffic()
    block_bytes(block, cfg, grid, tokens, e)
    forward_block_bytes(again, cfg, grid, tokens, e)

    def time_of(traffic: GridTraffic) -> float:
        total = 0.0
        for kind, nbytes in traffic.bytes.items():
            size, stride = group_shape(grid, kind)
            calls = traffic.calls[kind]
            if calls and size > 1:  # each call its share of the ring volume
                total += calls * seconds(size, stride, nbytes / calls * size / (size - 1))
        return total

    return dict(tp_collective_s=time_of(block) + recompute * time_of(again), tp_collectives_per_block=1,
                grid_block_bytes=block.total + recompute * again.total,
                grid_edge_bytes=whole.total - cfg.n_layers * block.total,
                grid_edge_s=time_of(whole) - cfg.n_layers * time_of(block))


def params_held(cfg: ModelConfig, lay: Layout, stage_params: float, first_stage: bool) -> float:
    """Parameters one rank of a stage holds: 1/tp of them under 1-D; on a grid the matrices'
    blocks (1/q², 2.5-D's depth layers each holding a copy; 3-D 1/q³) and 1/tp of the embedding."""
    if lay.tp_mode == "1d":
        return stage_params / lay.tp
    embedding = cfg.unit_params()[0] if first_stage else 0.0
    return (stage_params - embedding) / lay.grid.weight_parts + embedding / lay.tp
