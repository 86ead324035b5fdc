"""Context parallelism: each rank of a context-parallel group holds two chunks of every sequence
(strata/rules/context.py: chunks r and 2·cp-1-r of 2·cp), and attention, the one layer that reads
other tokens, sees the whole sequence by ring attention or by Ulysses' all-to-all.

`apply_context_parallel` gives the model a `SequenceChunks` (what it keeps of each sequence of
token ids and targets, and the positions of what it keeps, for rotary tables, learned positions
and masks) and swaps each block's core attention. Everything else (the linear layers, the norms,
the loss) works on the rank's tokens as on any tokens; the gradients of the replicated weights
are averaged over dp x cp by data parallelism, every rank holding as many tokens as another.

Ring attention (Liu et al. 2023; the merge is FlashAttention's online softmax, Dao et al. 2022):
at ring step j a rank attends to the K and V of rank r - j while sending them on to r + 1, and
merges each block's output with the running one through their log-sum-exps. Of the 2 x 2 pairs
of (query chunk, key chunk) a step brings, only those a query can see are computed: under the
causal mask a step's blocks are half visible, the balance the chunk pairing gives. The backward
recomputes each block's probabilities from the saved log-sum-exp, passes K and V around again,
and the gradients of K and V accumulate on their way round and take one last hop home."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist
import torch.nn.functional as F

from strata.distributed import comm
from strata.distributed.mesh import Axis
from strata.model.layers import attention_bias
from strata.parallel.tensor_comm import conjugate
from strata.rules.context import chunk_bounds

GROUP = "cp"


@dataclass(frozen=True)
class SequenceChunks:
    """What one rank of the context-parallel group keeps of each sequence: the model's
    `context` (None on one rank). Positions are the tokens' places in the whole sequence."""
    cp: int
    rank: int

    def bounds(self, local_len: int, rank: int | None = None) -> tuple[tuple[int, int], tuple[int, int]]:
        """The two ranges of the whole sequence a rank holds, given its local length."""
        return chunk_bounds(local_len * self.cp, self.cp, self.rank if rank is None else rank)

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's two chunks of (batch, seq, ...) token ids or targets, along dim 1."""
        (a, b), (c, d) = chunk_bounds(x.shape[1], self.cp, self.rank)
        return torch.cat([x[:, a:b], x[:, c:d]], dim=1)

    def positions(self, local_len: int, device, rank: int | None = None) -> torch.Tensor:
        (a, b), (c, d) = self.bounds(local_len, rank)
        return torch.cat([torch.arange(a, b, device=device), torch.arange(c, d, device=device)])


def apply_context_parallel(model, axis: Axis, mode: str) -> None:
    """Split the model's sequences over `axis` (the context-parallel group): the model keeps its
    chunks, each block attends by `mode` (ring | ulysses). On the meta-device model, before the
    pipeline split, compilation and checkpointing (which wraps the core this puts in place)."""
    model.context = SequenceChunks(axis.size, axis.rank)
    settings = AttentionSettings(axis, model.context, model.cfg.sliding_window, model)  # shared by the blocks
    for block in model.layers().values():
        block.attn.core = torch.compiler.disable((RingAttention if mode == "ring" else UlyssesAttention)(settings))


@dataclass(frozen=True)
class AttentionSettings:
    axis: Axis
    chunks: SequenceChunks
    window: int | None  # sliding window: a query sees the keys less than W positions back
    model: object  # read at call time: ALiBi's slopes for this rank's heads (model.alibi), if any
    _orders: dict = field(default_factory=dict, compare=False)

    def order(self, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Ulysses: the positions of every rank's tokens in rank order, and the permutation that
        sorts them; made once (every layer reads the same, and keeps it for backward once)."""
        key = (length, str(device))
        if key not in self._orders:
            order = torch.cat([self.chunks.positions(length, device, rank) for rank in range(self.axis.size)])
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


# --- ring attention ------------------------------------------------------------------------------
class RingAttention:
    """core(q, k, v, bias) for a rank holding two chunks of the sequence: (batch, heads, L, d)
    queries, (batch, kv_heads, L, d) keys and values; bias is unused (masks come from positions)."""

    def __init__(self, settings: AttentionSettings):
        self.settings = settings

    def __call__(self, q, k, v, bias=None):
        return _Ring.apply(q, k, v, self.settings)


def _visibility(q_range: tuple[int, int], k_range: tuple[int, int], window: int | None) -> str:
    """Whether the queries at positions q_range see the keys at k_range: "none", "all", or
    "some" (a mask is needed). Causal: a key at or before the query; window W: less than W back."""
    (qa, qb), (ka, kb) = q_range, k_range
    if ka > qb - 1 or (window is not None and kb - 1 <= qa - window):
        return "none"
    if kb - 1 <= qa and (window is None or ka > qb - 1 - window):
        return "all"
    return "some"


@dataclass
class _Pair:
    """One (query chunk, key chunk) block: slices of the local queries and of a K/V block, the
    mask or bias it needs (None: none), in the accumulation dtype."""
    q: slice
    k: slice
    bias: torch.Tensor | None


def _pairs(settings: AttentionSettings, local_len: int, source: int, heads: int, kv_heads: int,
           dtype, device) -> list[_Pair]:
    """The blocks of the queries this rank holds against the K/V block of rank `source` that
    any query can see, each with its additive mask (and ALiBi's distance penalty)."""
    chunks, half = settings.chunks, local_len // 2
    slopes = settings.slopes()
    pairs = []
    for qi, q_range in enumerate(chunks.bounds(local_len)):
        for ki, k_range in enumerate(chunks.bounds(local_len, source)):
            seen = _visibility(q_range, k_range, settings.window)
            if seen == "none":
                continue
            bias = None
            if seen == "some" or slopes is not None:
                pq = torch.arange(*q_range, device=device)[:, None]
                pk = torch.arange(*k_range, device=device)[None, :]
                bias = torch.zeros((len(pq), pk.shape[1]), dtype=dtype, device=device)
                if slopes is not None:  # (kv_heads, group, L, L): the query head h = kv_head x group + g
                    per_head = slopes.to(dtype).view(kv_heads, heads // kv_heads)[..., None, None]
                    bias = bias + per_head * (pk - pq).to(dtype)
                if seen == "some":
                    hidden = pk > pq
                    if settings.window is not None:
                        hidden = hidden | (pk <= pq - settings.window)
                    bias = bias.masked_fill(hidden, float("-inf"))
            pairs.append(_Pair(slice(qi * half, (qi + 1) * half), slice(ki * half, (ki + 1) * half), bias))
    return pairs


def _scores(q, k, pair: _Pair, scale: float) -> torch.Tensor:
    """(b, kv_heads, group, Lq, Lk) scores of a block: q (b, kv_heads, group, L, d), k (b, kv_heads, L, d)."""
    s = torch.einsum("bhgqd,bhkd->bhgqk", q[..., pair.q, :], k[..., pair.k, :]) * scale
    return s + pair.bias if pair.bias is not None else s


def _block_forward(q, k, v, pair: _Pair, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's softmax-weighted values and log-sum-exp per query (a query that sees no key of
    the block: output 0, log-sum-exp -inf)."""
    s = _scores(q, k, pair, scale)
    top = s.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(s - top)
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.einsum("bhgqk,bhkd->bhgqd", weights, v[..., pair.k, :]) / torch.where(total > 0, total, 1)
    return out, (top + total.log()).squeeze(-1)


def _merge(out, lse, block_out, block_lse):
    """The online softmax's merge of two partial attentions over disjoint keys."""
    merged = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isfinite(merged), merged, torch.zeros_like(merged))
    return (out * torch.exp(lse - safe)[..., None] + block_out * torch.exp(block_lse - safe)[..., None]), merged


def _exchange(tensor: torch.Tensor, settings: AttentionSettings, tag: int):
    """Send `tensor` to the next rank on the ring and receive the previous rank's into a new
    buffer; returns (buffer, handles)."""
    previous, following = settings.peers
    received = torch.empty_like(tensor)
    handles = comm.send_recv([(tensor, following, tag)], [(received, previous, tag)], settings.axis.group, GROUP)
    return received, handles


def _wait(handles) -> None:
    for handle in handles:
        handle.wait()


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, settings: AttentionSettings):
        b, heads, length, d = q.shape
        kv_heads = k.shape[1]
        acc = torch.promote_types(q.dtype, torch.float32)  # bf16 blocks merge in fp32
        scale = 1.0 / math.sqrt(d)
        qg = q.to(acc).view(b, kv_heads, heads // kv_heads, length, d)
        out = torch.zeros(qg.shape, dtype=acc, device=q.device)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v])  # one message per hop
        n, me = settings.axis.size, settings.axis.rank
        for step in range(n):
            handles = []
            if step < n - 1:  # the next block travels while this one is attended to
                incoming, handles = _exchange(kv, settings, step)
            keys, values = kv[0].to(acc), kv[1].to(acc)
            for pair in _pairs(settings, length, (me - step) % n, heads, kv_heads, acc, q.device):
                block_out, block_lse = _block_forward(qg, keys, values, pair, scale)
                rows = (Ellipsis, pair.q, slice(None))
                out[rows], lse[rows[:-1]] = _merge(out[rows], lse[rows[:-1]], block_out, block_lse)
            _wait(handles)
            if step < n - 1:
                kv = incoming
        # laid out (b, L, heads, d) as FlashAttention's output is, so that the output projection's
        # input (its transpose, flattened) is a view of it, not a second copy kept for backward
        result = torch.empty((b, length, heads, d), dtype=q.dtype, device=q.device).transpose(1, 2)
        result.copy_(out.view(b, heads, length, d))
        ctx.settings = settings
        # what FlashAttention keeps: the inputs, the output in their dtype, one log-sum-exp per query
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, result, lse = ctx.saved_tensors
        settings = ctx.settings
        b, heads, length, d = q.shape
        kv_heads = k.shape[1]
        acc, scale = lse.dtype, 1.0 / math.sqrt(d)
        shape = (b, kv_heads, heads // kv_heads, length, d)
        qg, out = q.to(acc).view(shape), result.to(acc).view(shape)
        dout = grad_out.to(acc).reshape(shape)
        delta = (dout * out).sum(dim=-1)  # D = rowsum(dO ∘ O)
        dq = torch.zeros_like(qg)
        kv = torch.stack([k, v])
        n, me = settings.axis.size, settings.axis.rank
        travelling = None  # the K/V gradient of the block before, on its way to its owner
        for step in range(n):
            handles = []
            if step < n - 1:
                incoming, handles = _exchange(kv, settings, 2 * step)
            keys, values = kv[0].to(acc), kv[1].to(acc)
            dkv = torch.zeros((2, *keys.shape), dtype=acc, device=q.device)
            for pair in _pairs(settings, length, (me - step) % n, heads, kv_heads, acc, q.device):
                rows = (Ellipsis, pair.q, slice(None))
                p = torch.exp(_scores(qg, keys, pair, scale) - lse[..., pair.q, None])
                dkv[1][..., pair.k, :] += torch.einsum("bhgqk,bhgqd->bhkd", p, dout[rows])
                dp = torch.einsum("bhgqd,bhkd->bhgqk", dout[rows], values[..., pair.k, :])
                ds = p * (dp - delta[..., pair.q, None]) * scale
                dq[rows] += torch.einsum("bhgqk,bhkd->bhgqd", ds, keys[..., pair.k, :])
                dkv[0][..., pair.k, :] += torch.einsum("bhgqk,bhgqd->bhkd", ds, qg[rows])
            if travelling is not None:  # what the ranks before added to this block's gradient
                _wait(travelling[1])
                dkv += travelling[0]
            travelling = _exchange(dkv, settings, 2 * step + 1)
            _wait(handles)
            if step < n - 1:
                kv = incoming
        _wait(travelling[1])  # the last hop: this rank's own block, every rank's part summed
        dkv = travelling[0]
        return dq.view(b, heads, length, d).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


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
        heads, kv_heads, length = q.shape[1], k.shape[1], q.shape[2]
        if kv_heads % axis.size:
            k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        order, natural = s.order(length, q.device)  # every rank's tokens in rank order; sorted
        q, k, v = (seq_to_heads(t, axis)[:, :, natural] for t in (q, k, v))
        slopes = s.slopes()
        if slopes is not None:  # this rank's heads of the tensor-parallel rank's
            part = heads // axis.size
            slopes = slopes[axis.rank * part:(axis.rank + 1) * part]
        mask = attention_bias(len(order), 0, None, slopes, q.dtype, q.device, s.window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return heads_to_seq(out[:, :, order], axis)
