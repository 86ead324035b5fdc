"""Cutting the model into pipeline chunks, and keeping on each rank only the layers of its chunks.

The model is a list of units: the embedding, the blocks, and the head (final norm, output
projection, loss). The p·v chunks are contiguous runs of units (chunk c on rank c % p); by default
they are balanced by forward FLOPs (the most expensive chunk is as cheap as it can be), or the
user gives the number of blocks per chunk (`--pp-split`). The embedding is always on chunk 0 and
the head on the last chunk.

A rank's model is the Transformer with the other ranks' layers removed; the blocks keep their
global names (blocks.7...), so checkpoints and tensor-parallel specs need no translation. With
interleaving a rank runs several chunks: each is a view of the rank's model (same layers, same
parameters) holding just that chunk's blocks. With tied embeddings the last stage keeps its own
copy of the embedding matrix for the head; the copies start equal (same seeded init) and their
gradients are summed over the first and last stage (Megatron's embedding group), so they stay equal."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch import nn

from strata.config import ConfigError
from strata.distributed.mesh import ParallelDims
from strata.model.config import ModelConfig
from strata.model.transformer import Transformer


@dataclass(frozen=True)
class PipelineLayout:
    stages: int  # p
    virtual_stages: int  # v: chunks per rank
    blocks_per_chunk: tuple[int, ...]  # p·v entries summing to n_layers

    @property
    def num_chunks(self) -> int:
        return self.stages * self.virtual_stages

    def chunks_of(self, pp_rank: int) -> list[int]:
        return list(range(pp_rank, self.num_chunks, self.stages))

    def rank_of(self, chunk: int) -> int:
        return chunk % self.stages

    def blocks_of(self, chunk: int) -> range:
        start = sum(self.blocks_per_chunk[:chunk])
        return range(start, start + self.blocks_per_chunk[chunk])


def unit_costs(cfg: ModelConfig, seq_len: int) -> list[float]:
    """Forward FLOPs per token of each unit: embedding (a lookup: ~d), each block (its matmuls and
    attention scores), head (the vocabulary projection)."""
    d, kv = cfg.d_model, cfg.kv_heads * cfg.head_dim
    matmuls = 2 * d * d + 2 * d * kv + (3 if cfg.mlp == "swiglu" else 2) * d * cfg.d_ff
    block = 2 * matmuls + 4 * seq_len * d
    return [float(d)] + [float(block)] * cfg.n_layers + [2.0 * d * cfg.vocab_size]


def balanced_split(costs: list[float], parts: int) -> list[int]:
    """Cut `costs` into `parts` contiguous non-empty runs minimising the largest run's sum; returns
    the length of each run. Exact dynamic programme (units are few)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]  # best[k][i]: first i units in k runs
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-9 * abs(value):  # ties: the earliest cut (fewer units early)
                    best[k][i], cut[k][i] = value, j
    lengths, i = [], n
    for k in range(parts, 0, -1):
        lengths.append(i - cut[k][i])
        i = cut[k][i]
    return lengths[::-1]


def make_layout(cfg: ModelConfig, stages: int, virtual_stages: int, seq_len: int,
                split: str | None = None) -> PipelineLayout:
    """The chunking for --pp, --virtual-stages and (optionally) --pp-split "n0,n1,...": blocks
    per chunk. Raises ConfigError when the model cannot be cut that way."""
    chunks = stages * virtual_stages
    if split:
        try:
            counts = tuple(int(x) for x in split.split(","))
        except ValueError:
            raise ConfigError(f"--pp-split {split}: give blocks per chunk as integers, e.g. 3,3") from None
        if len(counts) != chunks or sum(counts) != cfg.n_layers or min(counts) < 0:
            raise ConfigError(f"--pp-split {split}: needs {chunks} counts (pp x virtual stages) >= 0 "
                              f"summing to the model's {cfg.n_layers} layers")
        if any(c == 0 for c in counts[1:-1]):
            raise ConfigError(f"--pp-split {split}: only the first and last chunk may hold no blocks "
                              f"(they hold the embedding and the head)")
        return PipelineLayout(stages, virtual_stages, counts)
    units = cfg.n_layers + 2
    if chunks > units:
        raise ConfigError(f"--pp {stages} x --virtual-stages {virtual_stages} = {chunks} chunks, but the model "
                          f"has only {cfg.n_layers} layers + embedding + head = {units} units to split")
    lengths = balanced_split(unit_costs(cfg, seq_len), chunks)
    counts, start = [], 0
    for length in lengths:  # unit u is the embedding (0), block u-1, or the head (n_layers + 1)
        blocks = [u - 1 for u in range(start, start + length) if 1 <= u <= cfg.n_layers]
        counts.append(len(blocks))
        start += length
    return PipelineLayout(stages, virtual_stages, tuple(counts))


def keep_stage(model: Transformer, layout: PipelineLayout, pp_rank: int) -> None:
    """Remove, in place, every layer this rank's chunks do not hold (on the meta-device model)."""
    chunks = layout.chunks_of(pp_rank)
    mine = {str(b) for c in chunks for b in layout.blocks_of(c)}
    for key in list(model.blocks.keys()):
        if key not in mine:
            del model.blocks[key]
    first, last = 0 in chunks, layout.num_chunks - 1 in chunks
    if not first:
        model.pos_embed = model.embed_norm = None
        if not (last and model.head is None):  # tied: the last stage's head reads the embedding
            model.embed = None
    if not last:
        model.final_norm = model.head = None


def tied_copy(model: Transformer, layout: PipelineLayout, pp_rank: int) -> nn.Parameter | None:
    """The last stage's copy of a tied embedding (None elsewhere, and when not tied)."""
    chunks = layout.chunks_of(pp_rank)
    if model.cfg.tie_embeddings and layout.num_chunks - 1 in chunks and 0 not in chunks:
        return model.embed.weight
    return None


def chunk_views(model: Transformer, layout: PipelineLayout, pp_rank: int) -> dict[int, Transformer]:
    """chunk -> a module that runs just that chunk. With one chunk per rank it is the rank's model;
    otherwise a shallow copy sharing every layer, hook and parameter, with its own table of
    submodules (so removing the other chunks' blocks from it leaves the rank's model whole)."""
    chunks = layout.chunks_of(pp_rank)
    if len(chunks) == 1:
        return {chunks[0]: model}
    views = {}
    for c in chunks:
        view = copy.copy(model)
        view._modules = dict(model._modules)
        view.blocks = nn.ModuleDict({str(b): model.blocks[str(b)] for b in layout.blocks_of(c)})
        if c != layout.num_chunks - 1:
            view.final_norm = view.head = None  # stops at the hidden states
        views[c] = view
    return views


def embedding_group(dims: ParallelDims, rank: int, timeout_s: float):
    """The process group of the first and the last stage's ranks at this rank's (dp, tp) place,
    over which a tied embedding's gradients are summed; None on the other stages. Every rank
    creates every such group (torch.distributed requires it), in the same order."""
    mine = None
    for dp in range(dims.dp):
        for tp in range(dims.tp):
            ranks = [dims.rank_at(0, dp, tp), dims.rank_at(dims.pp - 1, dp, tp)]
            group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
            if rank in ranks:
                mine = group
    return mine
