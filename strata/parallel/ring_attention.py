"""Ring attention (Liu, Zaharia, Abbeel 2023) for context parallelism (strata/parallel/context.py):
each rank holds two chunks of the sequence; at ring step j it attends to the keys and values of
rank r - j while sending them on to rank r + 1, and merges each block's output with the running
one through their log-sum-exps (FlashAttention's online softmax, Dao et al. 2022).

Of the 2 x 2 (query chunk, key chunk) pairs a step brings, only those some query can see are
computed, each with the least masking it needs: none (every key visible), the causal diagonal
(the kernel's own causal mask), or an additive mask (a sliding window, ALiBi). Under the causal
mask the chunk pairing makes every step's work equal on every rank.

The backward recomputes each block's probabilities from the saved log-sum-exp of the whole row
and the final output (which is what makes a block's gradient its share of the whole), passes K
and V around again, and sends the gradients of K and V along with them, accumulating, with one
last hop to bring them to their owner.

A block is computed by PyTorch's fused flash-attention kernel for the CPU where it runs (it takes
a mask, returns the log-sum-exp and has a backward that takes the row's), else by `_Blockwise`,
matrix products over tiles of queries (any device; the tests hold both to the same reference)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from strata.distributed import comm
from strata.rules.context import chunk_bounds

GROUP = "cp"
TILE_ELEMENTS = 1 << 24  # the blockwise kernel's scores per tile of queries (64 MB in fp32)


class RingAttention:
    """core(q, k, v, bias) for a rank holding two chunks of the sequence: (batch, heads, L, d)
    queries, (batch, kv_heads, L, d) keys and values; bias is unused (masks come from the
    positions). settings: the axis, the chunks, the window, slopes() and the ring's peers
    (strata/parallel/context.AttentionSettings)."""

    def __init__(self, settings):
        self.settings = settings

    def __call__(self, q, k, v, bias=None):
        q, k, v = as_attention_computes(q, k, v)
        with torch.autocast(q.device.type, enabled=False):  # the blocks' arithmetic is chosen here
            return _Ring.apply(q, k, v, self.settings)


def as_attention_computes(q, k, v):
    """q, k and v in the dtype attention computes in: under autocast its dtype, as
    scaled_dot_product_attention casts them (rotary tables in fp32 leave q and k in fp32, v comes
    out of its projection in the autocast dtype); else as they are."""
    device = q.device.type
    if not torch.is_autocast_enabled(device):
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    return q.to(dtype), k.to(dtype), v.to(dtype)


# --- the blocks a step computes ------------------------------------------------------------------
def visibility(q_range: tuple[int, int], k_range: tuple[int, int], window: int | None) -> str:
    """Whether queries at positions q_range see keys at k_range: "none", "all", or "some" (a
    mask is needed). Causal: a key at or before the query; window W: fewer than W back."""
    (qa, qb), (ka, kb) = q_range, k_range
    if ka > qb - 1 or (window is not None and kb - 1 <= qa - window):
        return "none"
    if kb - 1 <= qa and (window is None or ka > qb - 1 - window):
        return "all"
    return "some"


@dataclass
class Block:
    """One (query chunk, key chunk) pair: slices of the local queries and of a K/V block; causal:
    the diagonal, masked by the kernel itself; bias: else the additive mask and ALiBi's penalty,
    (Lq, Lk) or (1, heads, Lq, Lk), in the queries' dtype; empty: queries that see none of its keys
    (a window), whose log-sum-exp the kernel would not leave at -inf."""
    q: slice
    k: slice
    causal: bool = False
    bias: torch.Tensor | None = None
    empty: torch.Tensor | None = None


def blocks(q_ranges, k_ranges, window: int | None, slopes: torch.Tensor | None, dtype, device) -> list[Block]:
    """The pairs of the local query chunks (positions q_ranges) and a K/V block's chunks that some
    query sees, with what each needs to be masked by."""
    found, half = [], q_ranges[0][1] - q_ranges[0][0]
    for qi, q_range in enumerate(q_ranges):
        for ki, k_range in enumerate(k_ranges):
            seen = visibility(q_range, k_range, window)
            if seen == "none":
                continue
            block = Block(slice(qi * half, (qi + 1) * half), slice(ki * half, (ki + 1) * half))
            if seen == "some" and q_range == k_range and window is None and slopes is None:
                block.causal = True
            elif seen == "some" or slopes is not None:
                pq = torch.arange(*q_range, device=device)[:, None]
                pk = torch.arange(*k_range, device=device)[None, :]
                bias = torch.zeros((half, half), dtype=dtype, device=device)
                if slopes is not None:  # (1, heads, Lq, Lk): the kernel takes masks of 2 or 4 dimensions
                    bias = slopes.to(dtype)[None, :, None, None] * (pk - pq).to(dtype)
                if seen == "some":
                    hidden = pk > pq
                    if window is not None:
                        hidden = hidden | (pk <= pq - window)
                    bias = bias.masked_fill(hidden, float("-inf"))
                    if window is not None:
                        block.empty = hidden.all(dim=-1)
                block.bias = bias
            found.append(block)
    return found


# --- the two kernels -----------------------------------------------------------------------------
class _Fused:
    """PyTorch's flash-attention kernel for the CPU (fp64, fp32, bf16; a mask; the log-sum-exp)."""

    @staticmethod
    def forward(q, k, v, block: Block, scale: float):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[:, :, block.q], k[:, :, block.k], v[:, :, block.k], 0.0, block.causal, attn_mask=block.bias, scale=scale)

    @staticmethod
    def backward(dout, q, k, v, out, lse, block: Block, scale: float):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout[:, :, block.q], q[:, :, block.q], k[:, :, block.k], v[:, :, block.k], out[:, :, block.q],
            lse[:, :, block.q], 0.0, block.causal, attn_mask=block.bias, scale=scale)


class _Blockwise:
    """Matrix products in the accumulation dtype, over tiles of queries so that a tile's scores stay
    within TILE_ELEMENTS."""

    @staticmethod
    def _tiles(q, k, block: Block):
        rows = block.q.stop - block.q.start
        per_row = q.shape[0] * q.shape[1] * (block.k.stop - block.k.start)
        step = max(1, min(rows, TILE_ELEMENTS // per_row))
        for start in range(0, rows, step):
            yield slice(start, min(rows, start + step))

    @staticmethod
    def _scores(q_tile, k_block, block: Block, tile: slice, scale: float):
        acc = torch.promote_types(q_tile.dtype, torch.float32)
        s = q_tile.to(acc) @ k_block.to(acc).transpose(-1, -2) * scale
        if block.causal:
            rows = torch.arange(tile.start, tile.stop, device=s.device)[:, None]
            return s.masked_fill(torch.arange(s.shape[-1], device=s.device)[None, :] > rows, float("-inf"))
        if block.bias is not None:
            return s + block.bias[..., tile, :].to(acc)
        return s

    @classmethod
    def forward(cls, q, k, v, block: Block, scale: float):
        qb, kb, vb = q[:, :, block.q], k[:, :, block.k], v[:, :, block.k]
        acc = torch.promote_types(q.dtype, torch.float32)
        outs, lses = [], []
        for tile in cls._tiles(q, k, block):
            s = cls._scores(qb[:, :, tile], kb, block, tile, scale)
            top = s.amax(dim=-1, keepdim=True)
            top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
            weights = torch.exp(s - top)
            total = weights.sum(dim=-1, keepdim=True)
            outs.append((weights @ vb.to(acc)) / torch.where(total > 0, total, 1))
            lses.append((top + total.log()).squeeze(-1))
        return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, block: Block, scale: float):
        acc = lse.dtype
        qb, kb, vb = (t.to(acc) for t in (q[:, :, block.q], k[:, :, block.k], v[:, :, block.k]))
        do, ob, lb = dout[:, :, block.q].to(acc), out[:, :, block.q].to(acc), lse[:, :, block.q]
        dq, dk, dv = torch.zeros_like(qb), torch.zeros_like(kb), torch.zeros_like(vb)
        for tile in cls._tiles(q, k, block):
            p = torch.exp(cls._scores(qb[:, :, tile], kb, block, tile, scale) - lb[:, :, tile, None])
            dv += p.transpose(-1, -2) @ do[:, :, tile]
            ds = p * (do[:, :, tile] @ vb.transpose(-1, -2) - (do[:, :, tile] * ob[:, :, tile]).sum(-1, keepdim=True))
            dq[:, :, tile] = ds @ kb * scale
            dk += ds.transpose(-1, -2) @ qb[:, :, tile] * scale
        return dq, dk, dv


def kernel_for(device: torch.device):
    return _Fused if device.type == "cpu" else _Blockwise


# --- the ring ------------------------------------------------------------------------------------
def _merge(out, lse, block_out, block_lse):
    """The online softmax's merge of two partial attentions over disjoint keys."""
    merged = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isfinite(merged), merged, torch.zeros_like(merged))
    return out * torch.exp(lse - safe)[..., None] + block_out * torch.exp(block_lse - safe)[..., None], merged


def _attend(q, keys, values, found: list[Block], out, lse, kernel, scale: float) -> None:
    """Attend q to one K/V block's `found` pairs and merge each into the running (out, lse), both
    in the accumulation dtype, in place."""
    for block in found:
        block_out, block_lse = kernel.forward(q, keys, values, block, scale)
        block_lse = block_lse.to(lse.dtype)
        if block.empty is not None:
            block_lse = block_lse.masked_fill(block.empty, float("-inf"))
        rows = (slice(None), slice(None), block.q)
        out[rows], lse[rows] = _merge(out[rows], lse[rows], block_out.to(out.dtype), block_lse)


def _exchange(tensor: torch.Tensor, settings):
    """Send `tensor` to the next rank on the ring and receive the previous rank's into a new
    buffer, as one batched operation; returns (buffer, its handle). Every rank exchanges the same
    messages in the same order (K/V, then in backward the K/V gradients between them), so the
    messages match in order, as NCCL matches them, without tags."""
    previous, following = settings.peers
    received = torch.empty_like(tensor)
    handle = comm.send_recv([(tensor, following)], [(received, previous)], settings.axis.group, GROUP)
    return received, handle


def _wait(handle) -> None:
    if handle is not None:
        handle.wait()


def _step_blocks(settings, step: int, dtype, device) -> list[Block]:
    source = (settings.axis.rank - step) % settings.axis.size
    return blocks(settings.chunks.bounds(), settings.chunks.bounds(source), settings.window, settings.slopes(), dtype,
                  device)


def _per_query_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V with its heads repeated to one per query head (grouped-query attention)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, settings):
        b, heads, length, d = q.shape
        acc = torch.promote_types(q.dtype, torch.float32)  # bf16 blocks merge in fp32
        scale, kernel = 1.0 / math.sqrt(d), kernel_for(q.device)
        out = torch.zeros((b, heads, length, d), dtype=acc, device=q.device)
        lse = torch.full((b, heads, length), float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v])  # one message per hop
        n = settings.axis.size
        for step in range(n):
            handle = None
            if step < n - 1:  # the next block travels while this one is attended to
                incoming, handle = _exchange(kv, settings)
            keys, values = (_per_query_head(t, heads) for t in kv)
            _attend(q, keys, values, _step_blocks(settings, step, q.dtype, q.device), out, lse, kernel, scale)
            _wait(handle)
            if step < n - 1:
                kv = incoming
        # laid out (b, L, heads, d) as FlashAttention's output is, so that the output projection's
        # input (its transpose, flattened) is a view of it, not a second copy kept for backward
        result = torch.empty((b, length, heads, d), dtype=q.dtype, device=q.device).transpose(1, 2)
        result.copy_(out)
        ctx.settings = settings
        # what FlashAttention keeps: the inputs, the output in their dtype, one log-sum-exp per query
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx, grad_out):
        # backward runs where loss.backward() was called, under autocast in strata's loop
        with torch.autocast(grad_out.device.type, enabled=False):
            return _Ring._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        settings = ctx.settings
        b, heads, length, d = q.shape
        kv_heads = k.shape[1]
        acc, scale, kernel = lse.dtype, 1.0 / math.sqrt(d), kernel_for(q.device)
        dout = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        n = settings.axis.size
        travelling = None  # the K/V gradient of the block before, on its way to its owner
        for step in range(n):
            handle = None
            if step < n - 1:
                incoming, handle = _exchange(kv, settings)
            keys, values = (_per_query_head(t, heads) for t in kv)
            dkv = torch.zeros((2, b, heads, length, d), dtype=acc, device=q.device)
            for block in _step_blocks(settings, step, q.dtype, q.device):
                dq_block, dk_block, dv_block = kernel.backward(dout, q, keys, values, out, lse, block, scale)
                dq[:, :, block.q] += dq_block.to(acc)
                dkv[0][:, :, block.k] += dk_block.to(acc)
                dkv[1][:, :, block.k] += dv_block.to(acc)
            if heads != kv_heads:  # each KV head's gradient: the sum over the query heads that read it
                dkv = dkv.view(2, b, kv_heads, heads // kv_heads, length, d).sum(dim=3)
            if travelling is not None:  # what the ranks before added to this block's gradient
                _wait(travelling[1])
                dkv += travelling[0]
            travelling = _exchange(dkv, settings)
            _wait(handle)
            if step < n - 1:
                kv = incoming
        _wait(travelling[1])  # the last hop: this rank's own block, every rank's part summed
        dkv = travelling[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def blocks_in_one_process(q, k, v, grad, cp: int, window: int | None, slopes, kernel=None):
    """What the ring computes, without a ring: q (b, heads, s, d), k and v (b, kv_heads, s, d) and
    the output's gradient over the whole sequence; every rank's two chunks of queries against every
    rank's K/V blocks, block by block with `kernel` (default: the device's), merged by log-sum-exp,
    then the backward's gradients from the merged output and log-sum-exp, K's and V's summed over
    the query heads that read them. Returns (output, dq, dk, dv) over the whole sequence: the
    reference the tests and the GPU check hold to one attention over it."""
    kernel = kernel or kernel_for(q.device)
    seq, heads, d = q.shape[2], q.shape[1], q.shape[3]
    acc, scale = torch.promote_types(q.dtype, torch.float32), 1.0 / math.sqrt(d)
    ranges = [chunk_bounds(seq, cp, r) for r in range(cp)]

    def keep(t, r):
        return torch.cat([t[:, :, a:b] for a, b in ranges[r]], dim=2)

    def put(whole, part, r):  # a rank's two chunks back at their places in the sequence
        half = part.shape[2] // 2
        for i, (a, b) in enumerate(ranges[r]):
            whole[:, :, a:b] += part[:, :, i * half:(i + 1) * half]

    keys = [_per_query_head(keep(k, r), heads) for r in range(cp)]
    values = [_per_query_head(keep(v, r), heads) for r in range(cp)]
    out_all, dq_all, dk_all, dv_all = (torch.zeros(q.shape, dtype=acc, device=q.device) for _ in range(4))
    for r in range(cp):
        mine = keep(q, r)
        found = [blocks(ranges[r], ranges[source], window, slopes, q.dtype, q.device) for source in range(cp)]
        out = torch.zeros(mine.shape, dtype=acc, device=q.device)
        lse = torch.full(mine.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        for source in range(cp):
            _attend(mine, keys[source], values[source], found[source], out, lse, kernel, scale)
        out = out.to(q.dtype)
        put(out_all, out.to(acc), r)
        dq = torch.zeros(mine.shape, dtype=acc, device=q.device)
        for source in range(cp):
            dk, dv = (torch.zeros(keys[source].shape, dtype=acc, device=q.device) for _ in range(2))
            for block in found[source]:
                dq_block, dk_block, dv_block = kernel.backward(keep(grad, r), mine, keys[source], values[source], out,
                                                               lse, block, scale)
                dq[:, :, block.q] += dq_block.to(acc)
                dk[:, :, block.k] += dk_block.to(acc)
                dv[:, :, block.k] += dv_block.to(acc)
            put(dk_all, dk, source)
            put(dv_all, dv, source)
        put(dq_all, dq, r)
    kv_heads = k.shape[1]
    if kv_heads != heads:  # each KV head's gradient: the sum over the query heads that read it
        dk_all, dv_all = (t.view(t.shape[0], kv_heads, heads // kv_heads, seq, d).sum(dim=2) for t in (dk_all, dv_all))
    return out_all.to(q.dtype), dq_all.to(q.dtype), dk_all.to(k.dtype), dv_all.to(v.dtype)
