"""Activation checkpointing (Chen et al. 2016; Korthikanti et al. 2022): keep less for backward and
recompute the rest in backward, trading compute for memory.

  none        every activation is kept
  full        each block keeps only its input; the whole block is recomputed in backward
              (Korthikanti's 2·sbh per layer, one extra forward of the blocks)
  selective   each block's core attention (softmax(qkᵀ)v) is recomputed, the rest kept: the
              5as/h term, the big one when the attention scores are stored. A fused attention
              kernel (SDPA on CPU and GPU) never stores them, so here it saves little.
  every:K     full checkpointing of the first K blocks of every chunk of layers (the whole model,
              or each pipeline chunk), the others kept: Megatron-LM's --recompute-method block

Applied by wrapping forward methods, so parameter names and the model's code are unchanged; it
uses torch.utils.checkpoint (non-reentrant), which recomputes with the same kernels and so gives
bit-identical gradients. The kept block inputs are reported to the saved-activation counter.

With `--offload-activations` the kept inputs leave memory too (strata/memory/tiers.py
`OffloadedActivations`): torch's checkpoint saves a region's inputs as saved tensors before it
installs its own hooks, so hooks installed around it see exactly those inputs and nothing else."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils.checkpoint import checkpoint

from strata.memory.activations import observe
from strata.rules.checkpointing import parse


def _checkpointed(forward, offload=None):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation, generation: nothing to save anyway
            return forward(*args, **kwargs)
        for a in args:  # what the region keeps: its inputs
            if isinstance(a, torch.Tensor) and a.requires_grad:
                observe(a)
        # Function modes active now (zero-bubble's weight-gradient deferral) must be active when
        # backward recomputes the region, or it would build a different graph (torch's private
        # helper is the only way to read the mode stack).
        modes = torch.overrides._get_current_function_mode_stack()
        with offload.hooks() if offload is not None else contextlib.nullcontext():
            return checkpoint(forward, *args, use_reentrant=False, context_fn=lambda: (
                contextlib.nullcontext(), _entered(modes)), **kwargs)
    return run


@contextlib.contextmanager
def _entered(modes):
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        yield


def apply_checkpointing(model, mode: str, chunks: list[range] | None = None, offload=None) -> None:
    """Wrap the blocks of strata's Transformer (any stage of it) for `mode`. chunks: the global
    block indices of each pipeline chunk this model holds (every:K counts from each chunk's start);
    None: the model's blocks are one chunk. offload: an OffloadedActivations for what is kept."""
    kind, k = parse(mode)
    if kind == "none":
        return
    layers = model.layers()
    if chunks is None:
        chunks = [range(min(layers), max(layers) + 1)] if layers else []
    for index, block in layers.items():
        if kind == "selective":
            block.wrap_core_attention(functools.partial(_checkpointed, offload=offload))
            continue
        start = next(c.start for c in chunks if index in c)
        if kind == "full" or index - start < k:
            block.forward = _checkpointed(block.forward, offload)
