"""Context parallelism: each rank of a context-parallel group holds two chunks of every sequence
(strata/rules/context.py: chunks r and 2·cp-1-r of 2·cp), and attention, the one layer that reads
other tokens, sees the whole sequence by ring attention (strata/parallel/ring_attention.py) or by
Ulysses' all-to-all (here).

`apply_context_parallel` gives the model a `SequenceChunks` (what it keeps of each sequence of
token ids and targets, and the positions of what it keeps, for rotary tables, learned positions
and masks) and swaps each block's core attention. Everything else (the linear layers, the norms,
the loss) works on the rank's tokens as on any tokens; the gradients of the replicated weights
are averaged over dp x cp by data parallelism, every rank holding as many tokens as another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist

from strata.distributed import comm
from strata.distributed.mesh import Axis
from strata.model.attention_blocks import CausalMask, as_attention_computes, causal_attention
from strata.parallel.ring_attention import GROUP, RingAttention
from strata.parallel.tensor_comm import conjugate
from strata.rules.context import chunk_bounds


@dataclass(frozen=True)
class SequenceChunks:
    """What one rank of the context-parallel group keeps of each sequence: the model's
    `context` (None on one rank). Positions are the tokens' places in the whole sequence, of the
    run's length (every batch's, training and evaluation): a later pipeline stage, handed hidden
    states (under sequence parallelism a tp-th of the rank's), cannot tell it from them."""
    cp: int
    rank: int
    seq_len: int

    def bounds(self, rank: int | None = None) -> tuple[tuple[int, int], tuple[int, int]]:
        """The two ranges of the sequence a rank (this one by default) holds."""
        return chunk_bounds(self.seq_len, self.cp, self.rank if rank is None else rank)

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's two chunks of (batch, seq, ...) token ids or targets, along dim 1."""
        (a, b), (c, d) = chunk_bounds(x.shape[1], self.cp, self.rank)
        return torch.cat([x[:, a:b], x[:, c:d]], dim=1)

    def positions(self, device, rank: int | None = None) -> torch.Tensor:
        (a, b), (c, d) = self.bounds(rank)
        return torch.cat([torch.arange(a, b, device=device), torch.arange(c, d, device=device)])


def apply_context_parallel(model, axis: Axis, mode: str, seq_len: int) -> None:
    """Split the model's sequences (of seq_len tokens) over `axis` (the context-parallel group):
    the model keeps its chunks, each block attends by `mode` (ring | ulysses). On the meta-device
    model, before the pipeline split, compilation and checkpointing (which wraps the core this puts
    in place)."""
    model.context = SequenceChunks(axis.size, axis.rank, seq_len)
    settings = AttentionSettings(axis, model.context, model.cfg.sliding_window, model)  # shared by the blocks
    core = torch.compiler.disable((RingAttention if mode == "ring" else UlyssesAttention)(settings))
    for block in model.layers().values():
        block.wrap_core_attention(lambda one_device_core: core)  # in its place


@dataclass(frozen=True)
class AttentionSettings:
    """What the blocks' attention needs of the layout, made once and shared by the blocks."""
    axis: Axis
    chunks: SequenceChunks
    window: int | None  # sliding window: a query sees the keys less than W positions back
    model: object  # read at call time: ALiBi's slopes for this rank's heads (model.alibi), if any
    _orders: dict = field(default_factory=dict, compare=False)

    def order(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Ulysses: the positions of every rank's tokens in rank order, and the permutation that
        sorts them; made once (every layer reads the same, and keeps it for backward once)."""
        key = str(device)
        if key not in self._orders:
            order = torch.cat([self.chunks.positions(device, rank) for rank in range(self.axis.size)])
            self._orders[key] = order, torch.argsort(order)
        return self._orders[key]

    def slopes(self) -> torch.Tensor | None:
        return self.model.alibi if self.model.cfg.position == "alibi" else None

    @cached_property
    def peers(self) -> tuple[int, int]:
        """(previous, next) rank on the ring, as global ranks."""
        ranks = dist.get_process_group_ranks(self.axis.group)
        me = self.axis.rank
        return ranks[(me - 1) % len(ranks)], ranks[(me + 1) % len(ranks)]


# --- Ulysses -------------------------------------------------------------------------------------
def _seq_to_heads(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """(b, h, L, d), this rank's L tokens of every head -> (b, h/cp, cp·L, d), every rank's tokens
    (in rank order) of this rank's h/cp heads."""
    b, h, length, d = x.shape
    n = axis.size
    send = x.reshape(b, n, h // n, length, d).transpose(0, 1).contiguous()
    received = torch.empty_like(send)
    comm.all_to_all(received, send, axis.group, GROUP)
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * length, d)


def _heads_to_seq(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """The inverse of `_seq_to_heads`."""
    b, h_part, total, d = x.shape
    n = axis.size
    send = x.reshape(b, h_part, n, total // n, d).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    comm.all_to_all(received, send, axis.group, GROUP)
    return received.transpose(0, 1).reshape(b, n * h_part, total // n, d)


seq_to_heads = conjugate("SeqToHeads", _seq_to_heads, _heads_to_seq)
heads_to_seq = conjugate("HeadsToSeq", _heads_to_seq, _seq_to_heads)


class UlyssesAttention:
    """core(q, k, v, bias): all-to-all from the sequence split to a split of the heads, attention
    over the whole sequence in its order, all-to-all back. KV heads that cp does not divide are
    repeated to one per query head first."""

    def __init__(self, settings: AttentionSettings):
        self.settings = settings

    def __call__(self, q, k, v, bias=None):
        s, axis = self.settings, self.settings.axis
        q, k, v = as_attention_computes(q, k, v)  # what travels: what SDPA would compute with
        heads, kv_heads = q.shape[1], k.shape[1]
        if kv_heads % axis.size:
            k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        order, natural = s.order(q.device)  # every rank's tokens in rank order; sorted
        q, k, v = (seq_to_heads(t, axis)[:, :, natural] for t in (q, k, v))
        slopes = s.slopes()
        if slopes is not None:  # this rank's heads of the tensor-parallel rank's
            part = heads // axis.size
            slopes = slopes[axis.rank * part:(axis.rank + 1) * part]
        out = causal_attention(q, k, v, CausalMask(s.window, slopes))
        return heads_to_seq(out[:, :, order], axis)
