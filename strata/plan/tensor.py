"""Tensor parallelism for the cost model, 1-D and the grids (2-D, 2.5-D, 3-D): the bytes are
strata/rules/tensor_traffic.py's (the count the runtime's collectives are tested against, sub-group
by sub-group and operation by operation), each collective timed on the link its group crosses;
the parameters a rank holds and the grids' transient buffers."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from strata.model.config import ModelConfig
from strata.plan.links import Cluster, collective_seconds
from strata.rules.layout import Layout
from strata.rules.tensor_modes import TensorGrid, members_of, padded_vocab
from strata.rules.tensor_traffic import (
    ElementBytes,
    GridTraffic,
    block_linears,
    grid_parts,
    megatron_block_collectives,
    megatron_edge_volumes,
    one_call_per_group,
)


@dataclass(frozen=True)
class Part:
    bytes: float  # a rank sends
    seconds: float


@dataclass(frozen=True)
class GridCost:
    """Per micro-batch: the embedding (first stage), one block, one block's forward again (full
    recomputation), the final norm, head and loss (last stage); once a step, the partial
    gradients' sums of the first stage, of one block and of the last stage."""
    first: Part
    block: Part
    again: Part
    last: Part
    first_step: Part
    block_step: Part
    last_step: Part


def grid_cost(cfg: ModelConfig, grid: TensorGrid, tokens: int, e: ElementBytes, cluster: Cluster) -> GridCost:
    """A grid's traffic by part, each collective timed on the link its sub-group crosses."""

    def priced(part: _PartCollectives) -> Part:
        total = 0.0
        for op, per_call, calls, size, stride in part.collectives:
            total += calls * collective_seconds(cluster, op, per_call, size, stride)
        return Part(part.bytes, total)

    return GridCost(*(priced(part) for part in _grid_collectives(cfg, grid, tokens, e, cluster.devices_per_node)))


@dataclass(frozen=True)
class _PartCollectives:
    """One part of a grid's traffic: the bytes a rank sends, and each collective it enters as
    (op, bytes per call, calls, size, stride of the evenly spaced group it is timed as)."""
    bytes: float
    collectives: tuple[tuple[str, float, int, int, int], ...]


@lru_cache(maxsize=1024)
def _grid_collectives(cfg: ModelConfig, grid: TensorGrid, tokens: int, e: ElementBytes,
                      per_node: int) -> tuple[_PartCollectives, ...]:
    """grid_cost's parts in GridCost's order, before any link prices them: the same for every
    layout of this grid and micro-batch (the search prices thousands), so counted once."""
    parts = grid_parts(cfg, grid, tokens, e)

    def collectives(traffic: GridTraffic) -> _PartCollectives:
        found = []
        for (kind, op), nbytes in traffic.bytes.items():
            members, calls = members_of(grid, kind), traffic.calls[(kind, op)]
            size = len(members)
            if calls and size > 1:  # back from the ring volume to the tensor each call moves
                per_call = nbytes / calls / ((2 if op == "all_reduce" else 1) * (size - 1) / size)
                found.append((op, per_call, calls, *spread(members, per_node)))
        return _PartCollectives(traffic.total, tuple(found))

    return (collectives(parts.first), collectives(parts.block), collectives(parts.again), collectives(parts.last),
            collectives(one_call_per_group(parts.first_step)), collectives(one_call_per_group(parts.block_step)),
            collectives(one_call_per_group(parts.last_step)))


def element_bytes(lay: Layout, act_bytes: int, gather_bytes: int) -> ElementBytes:
    """What the grid's collectives move per element: the blocks in the activations' dtype, the
    statistics and the loss's sums in fp32 or wider, the parameters' in their dtype (under mixed
    precision fp32, or bf16 weights with gather=bf16)."""
    return ElementBytes(act_bytes, max(act_bytes, 4), gather_bytes if act_bytes == 2 else act_bytes)


def params_held(cfg: ModelConfig, lay: Layout, stage_params: float, layers: int, first: bool, last: bool) -> float:
    """Parameters one rank of a stage holds: 1/tp of them under 1-D. On a grid the matrices'
    blocks (1/q²: 2.5-D's depth layers each hold a copy; 3-D 1/q³), the embedding's 1/tp (and a
    tied head's copy on a last stage), the vectors cut by features only (1/q: norms, biases, a
    position table) and Qwen3's per-head norms whole."""
    if lay.tp_mode == "1d":
        return stage_params / lay.tp
    grid, h = lay.grid, cfg.d_model
    norm = (2 if cfg.norm == "layernorm" else 1) * h
    per_block = 2 * norm + sum(m for _, m, bias, _ in block_linears(cfg) if bias)
    whole = layers * (2 * cfg.head_dim if cfg.qk_norm else 0)
    by_features = layers * per_block + (norm + (cfg.vocab_size if cfg.bias and not cfg.tie_embeddings else 0)
                                        if last else 0)
    embedding = cfg.vocab_size * h * (int(first) + int(last and not first and cfg.tie_embeddings))
    if first:
        by_features += (cfg.max_seq_len * h if cfg.position == "learned" else 0) + (norm if cfg.embedding_norm else 0)
    matrices = stage_params - whole - by_features - embedding
    return matrices / grid.weight_parts + embedding / grid.size + by_features / grid.q + whole


def buffer_bytes(cfg: ModelConfig, grid: TensorGrid, tokens: int, act_bytes: int) -> float:
    """The largest transient a grid layer holds while it runs, beside what it keeps: a linear
    layer's gathered input and weight (and 3-D's output before its reduce-scatter), or a tied head's
    gathered sequences and partial logits, in the activations' dtype."""
    q, b = grid.q, grid.batch_parts

    def gathered(k: float, m: float) -> float:
        if grid.mode == "3d":
            return tokens / q * k / q + m / q * k / q + tokens / q * m / q
        return tokens / b * k + m / q * k

    vocab = padded_vocab(cfg.vocab_size, grid)
    head = tokens * cfg.d_model / q + tokens * vocab / b if cfg.tie_embeddings else gathered(cfg.d_model, vocab)
    return max([gathered(k, m) for k, m, _, _ in block_linears(cfg)] + [head]) * act_bytes


def spread(members: list[int], per_node: int) -> tuple[int, int]:
    """(size, stride) of the evenly spaced group that has as many members in each node as a grid's
    sub-group, given as places in a tensor-parallel group that starts a node."""
    in_first = sum(1 for m in members if m // per_node == members[0] // per_node)
    if in_first == len(members):
        return len(members), 1
    return len(members), per_node // in_first if in_first > 1 else per_node


def stage_seconds(cluster: Cluster, lay: Layout, grid: GridCost | None, collective_s: float, tp_message: float,
                  tokens: int, d_model: int, layers: int, first: bool, last: bool) -> tuple[float, float, float, float]:
    """(seconds, bytes) of one micro-batch's tensor-parallel collectives on this stage, and (seconds,
    bytes) of the step's sums of partial gradients: rules/tensor_traffic.py's counts."""
    t, full = lay.tp, lay.checkpointing == "full"
    if t == 1:
        return 0.0, 0.0, 0.0, 0.0
    if grid is not None:
        g = grid
        per_micro_batch = [(g.block, layers), (g.again, layers * full), (g.first, first),
                           (g.last, last)]
        per_step = [(g.block_step, layers), (g.first_step, first), (g.last_step, last)]
        return (sum(p.seconds * n for p, n in per_micro_batch), sum(p.bytes * n for p, n in per_micro_batch),
                sum(p.seconds * n for p, n in per_step), sum(p.bytes * n for p, n in per_step))
    sp = lay.sequence_parallel
    per_call = 1 if sp else 2  # ring volumes of tp_message
    first_volumes, last_volumes = megatron_edge_volumes(sp)
    calls = layers * megatron_block_collectives(sp, full) + \
        (first * first_volumes + last * last_volumes) / per_call
    loss = 3 * tokens * 4  # the vocabulary-parallel loss's three numbers per token
    # the loss's two all-reduces, on the last stage only (not timed for the others: the search asks
    # for every stage of every layout)
    loss_seconds = collective_seconds(cluster, "all_reduce", tokens * 4, t, 1) + \
        collective_seconds(cluster, "all_reduce", 2 * tokens * 4, t, 1) if last else 0.0
    seconds = calls * collective_s + loss_seconds
    tp_bytes = calls * per_call * (t - 1) / t * tp_message + last * 2 * (t - 1) / t * loss
    if not sp:
        return seconds, tp_bytes, 0.0, 0.0
    # once a step under sequence parallelism: the gradients of this stage's norms (fp32 parameters)
    norms = (2 * layers + last) * d_model * 4
    step_seconds = collective_seconds(cluster, "all_reduce", norms, t, 1)
    return seconds, tp_bytes, step_seconds, 2 * (t - 1) / t * norms


def overlapped_tp_seconds(tp_seconds: float, gemm_seconds: float, tp: int) -> float:
    """What of 1-D tensor parallelism's collectives stays on the critical path when they overlap the
    GEMMs they feed (Megatron-Core's --tp-comm-overlap, Transformer Engine's userbuffers: each
    all-gather / reduce-scatter split into tp chunks pipelined with the GEMM's chunks): the first
    chunk's transfer, which no GEMM covers (1/tp of it), and whatever exceeds the GEMMs' time."""
    return max(tp_seconds / tp, tp_seconds - gemm_seconds)
