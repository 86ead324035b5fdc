"""Keeping on each rank only the layers of its pipeline chunks (the cut itself is
strata/rules/pipeline_cut.py).

A rank's model is the Transformer with the other ranks' layers removed; the blocks keep their
global names (blocks.7...), so checkpoints and tensor-parallel specs need no translation. With
interleaving a rank runs several chunks: each is a view of the rank's model (same layers, same
parameters) holding just that chunk's blocks. With tied embeddings the last stage keeps its own
copy of the embedding matrix for the head; the copies start equal (same seeded init) and their
gradients are summed over the first and last stage (Megatron's embedding group), so they stay equal."""

from __future__ import annotations

import copy
from datetime import timedelta

import torch.distributed as dist
from torch import nn

from strata.distributed.mesh import ParallelDims
from strata.model.transformer import Transformer
from strata.rules.pipeline_cut import PipelineLayout


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
