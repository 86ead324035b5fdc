"""Keeping on each rank only the layers of its pipeline chunks (the cut itself is
strata/rules/pipeline_cut.py).

A rank's model is the Transformer with the other ranks' layers removed; the blocks keep their
global names (blocks.7...), so checkpoints and tensor-parallel specs need no translation. With
interleaving a rank runs several chunks: each is a view of the rank's model (same layers, same
parameters) holding just that chunk's blocks. With tied embeddings the last stage keeps its own
copy of the embedding matrix for the head; the copies start equal (same seeded init) and their
gradients are summed over the first and last stage (Megatron's embedding group), so they stay equal."""

from __future__ import annotations

from torch import nn

from strata.model.transformer import Transformer
from strata.rules.pipeline_cut import PipelineLayout


def keep_stage(model: Transformer, layout: PipelineLayout, pp_rank: int) -> None:
    """Remove, in place, every layer this rank's chunks do not hold (on the meta-device model)."""
    chunks = layout.chunks_of(pp_rank)
    model.keep({b for c in chunks for b in layout.blocks_of(c)}, inputs=0 in chunks,
               outputs=layout.num_chunks - 1 in chunks)


def tied_copy(model: Transformer, layout: PipelineLayout, pp_rank: int) -> nn.Parameter | None:
    """The last stage's copy of a tied embedding (None elsewhere, and when not tied)."""
    return model.tied_weight() if 0 not in layout.chunks_of(pp_rank) else None


def chunk_views(model: Transformer, layout: PipelineLayout, pp_rank: int) -> dict[int, Transformer]:
    """chunk -> a module that runs just that chunk: the rank's model when it runs one chunk, else a
    view of it holding the chunk's blocks (so removing the others leaves the rank's model whole)."""
    chunks = layout.chunks_of(pp_rank)
    if len(chunks) == 1:
        return {chunks[0]: model}
    return {c: model.view(layout.blocks_of(c), outputs=c == layout.num_chunks - 1) for c in chunks}


def stage_parameters(model: Transformer, layout: PipelineLayout) -> list[list[tuple[str, nn.Parameter]]]:
    """The parameters each chunk of `layout` would hold, on one process that holds them all: its
    blocks, the inputs on the first, the outputs on the last (what `keep_stage` keeps)."""
    names = {id(p): name for name, p in model.named_parameters()}
    last = layout.num_chunks - 1
    stages = []
    for c in range(layout.num_chunks):
        modules = [model.layers()[b] for b in layout.blocks_of(c)]
        modules += (model.input_layers() if c == 0 else []) + (model.output_layers() if c == last else [])
        params = {id(p): p for module in modules for p in module.parameters() if p.requires_grad}
        stages.append([(names[i], p) for i, p in params.items()])
    return stages
