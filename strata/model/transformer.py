"""The decoder-only transformer: embeddings, a stack of blocks, a final norm and the vocabulary head.

Written once, for one device. Build it on the meta device (no memory), move it with `to_empty`,
then `init_weights(seed)`: every element of every parameter is a function of the run seed, the
parameter's own name and the element's index (strata/model/initial_values.py), so any slicing of
the model (tensor, pipeline or ZeRO-3 parallel) starts from exactly the weights a single process
would have, and makes only its own piece.

A pipeline stage is this same model with layers removed (torchtitan's way): the blocks live in a
ModuleDict keyed by their global index, so a stage's parameters keep their full names; the forward
embeds only when given token ids (a later stage is given hidden states) and stops at the hidden
states when the final norm is gone."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from strata.model.attention_blocks import CausalMask
from strata.model.config import ModelConfig
from strata.model.families import FAMILIES
from strata.model.initial_values import initial_value
from strata.model.layers import Block, CrossEntropy, alibi_slopes, attention_bias, make_norm, rope_tables
from strata.model.loss import chunk_bounds, chunked_loss
from strata.model.moe import RouterLosses


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.position == "learned" else None
        self.embed_norm = make_norm(cfg) if cfg.embedding_norm else None
        # What hands the embeddings to the blocks: identity here; sequence parallelism splits the
        # sequence in its place.
        self.to_blocks = nn.Identity()
        # What this rank keeps of each sequence (context parallelism: strata/parallel/context.py):
        # None keeps all of it; else `.keep(ids)` cuts token ids and targets, `.positions(device)`
        # gives the kept tokens' places, and attention masks by them itself.
        self.context = None
        # what the MoE layers route and the scale of their auxiliary loss's gradient (None: dense)
        self.router_losses = RouterLosses(cfg.moe_layer_count(), cfg.router_aux_coef) if cfg.moe else None
        # the shared Block, or the family's own (GPT-J's, GPT-NeoX's: families/base.OwnBlock)
        family = FAMILIES.get(cfg.family)
        self.own_block = family.block if family is not None and cfg.own_block() is not None else None
        self.blocks = nn.ModuleDict({str(i): self.own_block.make(cfg, self.router_losses, i)
                                     if self.own_block is not None else Block(cfg, self.router_losses)
                                     for i in range(cfg.n_layers)})
        self.final_norm = make_norm(cfg)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=cfg.bias)
        # Layers without weights that a parallel version replaces: the loss, and what turns the
        # head's output into the logits a sampler reads (identity on one device).
        self.criterion = CrossEntropy()
        # Gemma 2's final logit soft cap c: the logits become c · tanh(logits / c) (0: none). Elementwise,
        # so a vocabulary-parallel rank caps its own columns and the loss needs no change.
        own_cap = self.own_block.final_logit_softcap if self.own_block is not None else None
        self.logit_softcap = own_cap(cfg) if own_cap is not None else 0.0
        self.gather_logits = nn.Identity()
        # Position tables are derived, not learned: not saved in checkpoints, rebuilt by init_weights.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.register_buffer("alibi", torch.empty(0), persistent=False)
        self.heads = range(cfg.n_heads)  # the query heads this model computes (a slice under tensor parallelism)
        if cfg.position == "rope":
            self.rope_cos, self.rope_sin = self.rope_tables()
        if cfg.position == "alibi":
            self.alibi = alibi_slopes(cfg.n_heads)

    def rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin by position (fp64): the family's own block's (partial, interleaved)
        or the whole head's in the "rotate half" layout."""
        own = self.own_block
        return own.rope_tables(self.cfg) if own is not None and own.rope_tables is not None else rope_tables(self.cfg)

    # --- initialisation ---------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter from (seed, its name); rebuild the position tables."""
        for name, param in self.named_parameters():
            param.copy_(initial_value(name, tuple(param.shape), seed, self.cfg.n_layers, self.cfg.norm))
        self.init_state_buffers(param.device, param.dtype)
        self.reset_buffers()

    @torch.no_grad()
    def init_state_buffers(self, device, dtype) -> None:
        """Each persistent buffer (state a checkpoint keeps that no optimizer trains: DeepSeek-V3's
        expert bias) at its initial value, zero, on `device` (from the meta device too)."""
        for module in self.modules():
            for name, buf in module._buffers.items():
                if buf is not None and name not in module._non_persistent_buffers_set:
                    module._buffers[name] = torch.zeros(buf.shape, device=device, dtype=dtype)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        cfg, sample = self.cfg, next(self.parameters())  # any layer: a pipeline stage may lack the embedding
        device, dtype = sample.device, sample.dtype
        if cfg.position == "rope":
            cos, sin = self.rope_tables()
            self.rope_cos, self.rope_sin = cos.to(device, dtype), sin.to(device, dtype)
        if cfg.position == "alibi":
            self.alibi = alibi_slopes(cfg.n_heads)[self.heads.start:self.heads.stop].to(device, dtype)

    # --- the structure parallelism reads --------------------------------------------------------
    # Tensor, pipeline and data parallelism, checkpointing and the trainer reach the layers through
    # these methods and the family's placement table, never by a layer's name (tests/test_layers.py).
    def layers(self) -> dict[int, nn.Module]:
        """The blocks this model (or pipeline stage) holds, by global index: the units the pipeline
        cuts between, activation checkpointing wraps and ZeRO-3 gathers one at a time."""
        return {int(key): block for key, block in self.blocks.items()}

    def input_layers(self) -> list[nn.Module]:
        """What turns token ids into the first block's input (with any weights): the first unit."""
        return [m for m in (self.embed, self.pos_embed, self.embed_norm) if m is not None]

    def output_layers(self) -> list[nn.Module]:
        """What turns the last block's output into logits (a tied head's matrix is the input's)."""
        return [m for m in (self.final_norm, self.head) if m is not None]

    def units(self) -> list[list[nn.Module]]:
        """The model as ZeRO-3 gathers it: the inputs, each block, the outputs."""
        return [self.input_layers(), *[[block] for block in self.layers().values()], self.output_layers()]

    def tied_weight(self) -> nn.Parameter | None:
        """The token embedding's matrix when the head reads it too (and this model holds it)."""
        return self.embed.weight if self.cfg.tie_embeddings and self.embed is not None else None

    def keep(self, layers: set[int], inputs: bool, outputs: bool) -> None:
        """Remove every layer not held here (a pipeline stage, on the meta device). A last stage of
        a tied model keeps the embedding: its head reads it."""
        for key in list(self.blocks.keys()):
            if int(key) not in layers:
                del self.blocks[key]
        if not inputs:
            self.pos_embed = self.embed_norm = None
            if not (outputs and self.cfg.tie_embeddings):
                self.embed = None
        if not outputs:
            self.final_norm = self.head = None

    def view(self, layers, outputs: bool) -> "Transformer":
        """A module that runs just `layers` (a pipeline chunk): a shallow copy sharing every layer,
        hook and parameter, with its own table of submodules; without outputs it stops at the
        hidden states."""
        view = copy.copy(self)
        view._modules = dict(self._modules)
        view.blocks = nn.ModuleDict({str(i): self.blocks[str(i)] for i in layers})
        if not outputs:
            view.final_norm = view.head = None
        return view

    def set_tied_head(self, head: nn.Module) -> None:
        """A tied model's head as a module of its own that reads the embedding's matrix itself (2-D,
        2.5-D and 3-D tensor parallelism cut the head's use of it differently from the lookup's)."""
        assert self.cfg.tie_embeddings, "only a tied model's head reads the embedding"
        self.head = head

    def keep_heads(self, heads: range) -> None:
        """Compute only these query heads (tensor parallelism): ALiBi's slopes are per head."""
        self.heads = heads
        if self.cfg.position == "alibi" and self.alibi.numel():
            self.alibi = alibi_slopes(self.cfg.n_heads)[heads.start:heads.stop].to(self.alibi)

    # --- forward ----------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, cache=None,
                last_only: bool = False):
        """tokens: (batch, seq) ids, or hidden states (batch, seq, d_model) from an earlier
        pipeline stage. With targets, returns the mean cross-entropy; without, the logits (of the
        last position only with last_only, as generation wants); a stage without the final norm
        returns its hidden states. cache: the KV cache of generation (strata.infer.kv_cache), or
        None."""
        start = cache.pos if cache is not None else 0
        positions = cache.positions(tokens.shape[1]) if cache is not None else None  # per row, when rows are padded
        if self.context is not None:  # this rank's chunks of every sequence (hidden states come cut)
            tokens = tokens if tokens.is_floating_point() else self.context.keep(tokens)
            targets = self.context.keep(targets) if targets is not None else None
            positions = self.context.positions(tokens.device)
        seq = tokens.shape[1]
        h = tokens if tokens.is_floating_point() else self.to_blocks(self.embed_tokens(tokens, start, positions))
        rope = None
        if self.cfg.position == "rope":  # from this position on; attention takes what it needs
            rope = (self.rope_cos[start:], self.rope_sin[start:]) if positions is None else \
                (self.rope_cos[positions], self.rope_sin[positions]) if positions.dim() == 1 else \
                (self.rope_cos[positions][:, None], self.rope_sin[positions][:, None])
        alibi = self.alibi if self.cfg.position == "alibi" else None
        window = self.cfg.sliding_window
        if self.context is not None:  # context parallelism's attention makes its own masks
            bias = None
        elif cache is not None:  # generation: padding slots and a cache's offset, as an additive mask
            bias = attention_bias(seq, start, cache.pad, alibi, h.dtype, h.device, window)
        else:  # training: by blocks, no S x S mask
            bias = CausalMask(window, alibi) if alibi is not None or window else None
        for i, block in enumerate(self.blocks.values()):
            h = block(h, rope, bias, cache[i] if cache is not None else None)
        if cache is not None:
            cache.advance(seq)
        if self.final_norm is None:
            return h
        if targets is None:
            return self.gather_logits(self.output(h[:, -1:] if last_only else h))
        return self.loss(h, targets)

    def embed_tokens(self, tokens: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(tokens)
        if self.cfg.scale_embeddings:
            # transformers' GemmaTextScaledWordEmbedding: sqrt(hidden) as an fp32 tensor, cast to
            # the activations' dtype before multiplying (in bf16 sqrt(3072) = 55.4256 becomes 55.5)
            h = h * torch.tensor(self.cfg.d_model ** 0.5).to(h.dtype)
        if self.pos_embed is not None:
            if positions is None:
                positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
            h = h + self.pos_embed(positions)
        if self.embed_norm is not None:
            h = self.embed_norm(h)
        return h

    def output(self, h: torch.Tensor) -> torch.Tensor:
        return self.project(self.final_norm(h))

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """The logits of normed hidden states: the head's, or a tied model's embedding matrix's,
        soft-capped where the family caps them."""
        return self.cap_logits(F.linear(h, self.embed.weight) if self.head is None else self.head(h))

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.logit_softcap
        return cap * torch.tanh(logits / cap) if cap else logits

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of the last block's output. When the whole fp32 logits would pass
        loss.LOGITS_CHUNK_BYTES, in chunks of the sequence (strata/model/loss.py): only one
        chunk's logits ever exist."""
        h = self.final_norm(h)
        weights = self.head_weights()
        bounds = chunk_bounds(h.shape[0], h.shape[1], weights[0].shape[0])
        if bounds is None:  # one chunk: the logits kept for backward
            return self.criterion(self.project(h), targets)
        # the chunks run the head without its hooks: chunked_loss fires them once, around them all
        # (the head's own forward, read now: chunked_loss runs the chunks as the head's forward)
        head_forward = self.head.forward if self.head is not None else None
        project = (lambda part: self.cap_logits(head_forward(part))) if head_forward is not None else self.project
        return chunked_loss(h, targets, self.head, project, self.criterion, weights, bounds)

    def head_weights(self) -> list[nn.Parameter]:
        """What `project` reads: the head's parameters, and a tied model's embedding matrix (the
        first: its rows are this rank's logits' columns)."""
        tied = self.tied_weight()
        return ([tied] if tied is not None else []) + (list(self.head.parameters()) if self.head is not None else [])


def tensor_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of the model holds, by name: its parameters and persistent buffers."""
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu", dtype=torch.float32,
                seed: int | None = 0) -> Transformer:
    """Build on the meta device, then materialise on `device` in `dtype` and initialise.
    seed=None leaves the model on the meta device (for counting, planning)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    if seed is None:
        return model
    model = model.to_empty(device=device).to(dtype)
    model.init_weights(seed)
    return model
