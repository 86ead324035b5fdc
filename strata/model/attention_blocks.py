"""Causal attention over a sequence cut into blocks of (query chunk, key chunk), each computed by a
fused kernel that returns its log-sum-exp, merged by FlashAttention's online softmax (Dao et al.
2022). Two users:

- ring attention (strata/parallel/ring_attention.py): the blocks a ring step brings;
- sliding-window and ALiBi attention in one process (`causal_attention`): only the blocks the
  window lets some query see, each masked as little as it needs, so that neither an S x S mask nor
  an S x S score matrix ever exists (SDPA with a mask builds the mask, and with grouped-query heads
  on CUDA falls back to its math kernel, which builds the scores too).

A block needs no mask (every key visible), the causal diagonal (the kernel's own causal mask), or
an additive mask of its own (Lq, Lk) or (1, heads, Lq, Lk): a window's edge, ALiBi's distances.

The backward recomputes each block's probabilities from the log-sum-exp of the whole row and the
final output, which is what makes a block's gradient its share of the whole.

The kernels, by device:
  cpu    PyTorch's flash kernel for the CPU (fp64, fp32, bf16; takes a mask; returns the lse)
  cuda   SDPA's flash kernel (16-bit, no mask: grouped-query heads read in place, no copies) and
         its memory-efficient kernel (fp32, or a block with a mask; K/V repeated per query head
         for that block only, as that kernel has no grouped heads)
  other  `Blockwise`: matrix products over tiles of queries (fp64 on a GPU, other devices)
The tests hold every kernel to one attention over the whole sequence."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

TILE_ELEMENTS = 1 << 24  # Blockwise's scores per tile of queries (64 MB in fp32)
# One process: the chunk a sequence is cut into for windowed or ALiBi attention, at least this long
# (below it a kernel call costs more than the masked work it saves), and for a window about a
# quarter of it, so that most visible blocks need no mask.
ONE_PROCESS_CHUNK = 128


def as_attention_computes(q, k, v):
    """q, k and v in the dtype attention computes in: under autocast its dtype, as
    scaled_dot_product_attention casts them (rotary tables in fp32 leave q and k in fp32, v comes
    out of its projection in the autocast dtype); else as they are. Cast here, once per layer, not
    per block."""
    device = q.device.type
    if not torch.is_autocast_enabled(device):
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    return q.to(dtype), k.to(dtype), v.to(dtype)


# --- the blocks ----------------------------------------------------------------------------------
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
    (a window), whose log-sum-exp a kernel would not leave at -inf."""
    q: slice
    k: slice
    causal: bool = False
    bias: torch.Tensor | None = None
    empty: torch.Tensor | None = None


def _slices(ranges) -> list[slice]:
    """The local slices of chunks held one after another."""
    found, start = [], 0
    for a, b in ranges:
        found.append(slice(start, start + b - a))
        start += b - a
    return found


def blocks(q_ranges, k_ranges, window: int | None, slopes: torch.Tensor | None, dtype, device):
    """The pairs of the local query chunks (positions q_ranges, held in that order) and a K/V
    block's chunks (k_ranges) that some query sees, with what each needs to be masked by, one at a
    time (a block's mask lives while it is computed: all of them together would be the S x S mask)."""
    for q_range, q_slice in zip(q_ranges, _slices(q_ranges)):
        for k_range, k_slice in zip(k_ranges, _slices(k_ranges)):
            seen = visibility(q_range, k_range, window)
            if seen == "none":
                continue
            block = Block(q_slice, k_slice)
            # the diagonal of a chunk no longer than the window: the causal triangle, nothing else
            plain_diagonal = q_range == k_range and (window is None or q_range[1] - q_range[0] <= window)
            if seen == "some" and plain_diagonal and slopes is None:
                block.causal = True
            elif seen == "some" or slopes is not None:
                pq = torch.arange(*q_range, device=device)[:, None]
                pk = torch.arange(*k_range, device=device)[None, :]
                bias = torch.zeros((len(range(*q_range)), len(range(*k_range))), dtype=dtype, device=device)
                if slopes is not None:  # (1, heads, Lq, Lk): the kernels take masks of 2 or 4 dimensions
                    bias = slopes.to(device, dtype)[None, :, None, None] * (pk - pq).to(dtype)
                if seen == "some":
                    hidden = pk > pq
                    if window is not None:
                        hidden = hidden | (pk <= pq - window)
                    bias = bias.masked_fill(hidden, float("-inf"))
                    if window is not None:
                        block.empty = hidden.all(dim=-1)
                block.bias = bias
            yield block


def one_process_chunks(seq: int, window: int | None, chunk: int | None = None) -> list[tuple[int, int]]:
    """The chunks one process cuts a sequence into: halved while longer than `chunk` and even. By
    default a quarter of the window (most visible blocks then need no mask), or without a window
    (ALiBi: every block has a mask) an eighth of the sequence (36 blocks); ONE_PROCESS_CHUNK at least."""
    target = chunk or max(ONE_PROCESS_CHUNK, window // 4 if window is not None else seq // 8)
    size = seq
    while size > target and size % 2 == 0:
        size //= 2
    return [(start, start + size) for start in range(0, seq, size)]


# --- the kernels ---------------------------------------------------------------------------------
def _with_query_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V with its heads repeated to one per query head (grouped-query attention)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def to_kv_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A gradient over repeated heads summed back to each KV head (the query heads that read it)."""
    b, heads, length, d = grad.shape
    return grad if heads == kv_heads else grad.view(b, kv_heads, heads // kv_heads, length, d).sum(dim=2)


class CpuFlash:
    """PyTorch's flash-attention kernel for the CPU (fp64, fp32, bf16; a mask; the log-sum-exp)."""
    grouped_heads = False  # K/V come with one head per query head

    @staticmethod
    def forward(q, k, v, block: Block, scale: float):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[:, :, block.q], k[:, :, block.k], v[:, :, block.k], 0.0, block.causal, attn_mask=block.bias, scale=scale)

    @staticmethod
    def backward(dout, q, k, v, out, lse, block: Block, scale: float):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout[:, :, block.q], q[:, :, block.q], k[:, :, block.k], v[:, :, block.k], out[:, :, block.q],
            lse[:, :, block.q], 0.0, block.causal, attn_mask=block.bias, scale=scale)


class CudaFused:
    """SDPA's CUDA kernels, called below SDPA for their log-sum-exp: flash for a 16-bit block
    without a mask (K/V with their own heads: the kernel reads grouped heads in place), the
    memory-efficient kernel otherwise (fp32, or a mask). Checked on meta tensors in the tests and
    against one attention on a GPU by bench/gpu_check.py."""
    grouped_heads = True  # K/V keep their KV heads; the kernel repeats them where it must

    @staticmethod
    def _flash(q, block: Block) -> bool:
        return block.bias is None and q.dtype in (torch.float16, torch.bfloat16)

    @staticmethod
    def _bias(block: Block, q) -> torch.Tensor | None:
        """The block's mask as the memory-efficient kernel reads it: 4 dimensions, rows whose
        stride is a multiple of 16 elements (SDPA pads its masks so), broadcast over batch and heads."""
        if block.bias is None:
            return None
        bias = block.bias if block.bias.dim() == 4 else block.bias[None, None]
        lq, lk = bias.shape[-2:]
        padded = torch.zeros((*bias.shape[:-1], -(-lk // 16) * 16), dtype=q.dtype, device=q.device)
        padded[..., :lk] = bias
        return padded[..., :lk].expand(q.shape[0], q.shape[1], lq, lk)

    @classmethod
    def forward(cls, q, k, v, block: Block, scale: float):
        qb, kb, vb = q[:, :, block.q], k[:, :, block.k], v[:, :, block.k]
        if cls._flash(q, block):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qb, kb, vb, 0.0, block.causal,
                                                                          scale=scale)[:2]
            return out, lse
        heads = q.shape[1]
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            qb, _with_query_heads(kb, heads), _with_query_heads(vb, heads), cls._bias(block, qb), True, 0.0,
            block.causal, scale=scale)[:2]
        return out, lse[:, :, :qb.shape[2]]  # its log-sum-exp comes padded to 32 rows

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, block: Block, scale: float):
        qb, kb, vb = q[:, :, block.q], k[:, :, block.k], v[:, :, block.k]
        do, ob, lb = dout[:, :, block.q], out[:, :, block.q], lse[:, :, block.q].float().contiguous()
        lq, lk = qb.shape[2], kb.shape[2]
        if cls._flash(q, block):  # the random state is unused without dropout
            unused = torch.empty(2, dtype=torch.uint64, device=q.device)
            return torch.ops.aten._scaled_dot_product_flash_attention_backward(
                do, qb, kb, vb, ob, lb, None, None, lq, lk, 0.0, block.causal, unused, unused[0], scale=scale)
        heads, kv_heads = q.shape[1], k.shape[1]
        unused = torch.empty((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            do, qb, _with_query_heads(kb, heads), _with_query_heads(vb, heads), cls._bias(block, qb), ob,
            F.pad(lb, (0, -lq % 32)), unused, unused, 0.0, [True, True, True, False], block.causal, scale=scale)
        return dq, to_kv_heads(dk, kv_heads), to_kv_heads(dv, kv_heads)


class Blockwise:
    """Matrix products in the accumulation dtype, over tiles of queries so that a tile's scores stay
    within TILE_ELEMENTS: for what no fused kernel takes (fp64 on a GPU, other devices)."""
    grouped_heads = False

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


FUSED_CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def kernel_for(q: torch.Tensor):
    """The kernel for queries like q: the CPU's flash kernel, SDPA's CUDA kernels (their dtypes, head
    sizes a multiple of 8 up to 256), else Blockwise."""
    if q.device.type == "cpu":
        return CpuFlash
    d = q.shape[-1]
    if q.device.type in ("cuda", "meta") and q.dtype in FUSED_CUDA_DTYPES and d % 8 == 0 and d <= 256:
        return CudaFused
    return Blockwise


def keys_for(kernel, t: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V as `kernel` takes them: their own heads, or one per query head."""
    return t if kernel.grouped_heads else _with_query_heads(t, heads)


# --- merging -------------------------------------------------------------------------------------
def _merge(out, lse, block_out, block_lse):
    """The online softmax's merge of two partial attentions over disjoint keys."""
    merged = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isfinite(merged), merged, torch.zeros_like(merged))
    return out * torch.exp(lse - safe)[..., None] + block_out * torch.exp(block_lse - safe)[..., None], merged


def attend(q, keys, values, found, out, lse, kernel, scale: float) -> None:
    """Attend q to one K/V block's `found` pairs and merge each into the running (out, lse), both
    in the accumulation dtype, in place."""
    for block in found:
        block_out, block_lse = kernel.forward(q, keys, values, block, scale)
        block_lse, block_out = block_lse.to(lse.dtype), block_out.to(out.dtype)
        if block.empty is not None:  # rows that see none of the block's keys add nothing (not even a NaN)
            block_lse = block_lse.masked_fill(block.empty, float("-inf"))
            block_out = block_out.masked_fill(block.empty[..., None], 0.0)
        rows = (slice(None), slice(None), block.q)
        out[rows], lse[rows] = _merge(out[rows], lse[rows], block_out, block_lse)


def add_block_gradients(dout, q, keys, values, out, lse, found, kernel, scale: float, dq, dkv) -> None:
    """Each of `found`'s gradients, from the whole row's output and log-sum-exp, added into dq and
    dkv (K's and V's stacked, over the heads `keys` has)."""
    for block in found:
        dq_block, dk_block, dv_block = kernel.backward(dout, q, keys, values, out, lse, block, scale)
        dq[:, :, block.q] += dq_block.to(dq.dtype)
        dkv[0][:, :, block.k] += dk_block.to(dkv.dtype)
        dkv[1][:, :, block.k] += dv_block.to(dkv.dtype)


def empty_output(q, dtype):
    """The running output and log-sum-exp before any block: zeros and -inf."""
    b, heads, length, d = q.shape
    return (torch.zeros((b, heads, length, d), dtype=dtype, device=q.device),
            torch.full((b, heads, length), float("-inf"), dtype=dtype, device=q.device))


def as_flash_output(out, dtype):
    """The output laid out (b, L, heads, d) as FlashAttention's is, so that the output projection's
    input (its transpose, flattened) is a view of it, not a second copy kept for backward."""
    b, heads, length, d = out.shape
    result = torch.empty((b, length, heads, d), dtype=dtype, device=out.device).transpose(1, 2)
    result.copy_(out)
    return result


# --- one process ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class CausalMask:
    """Causal attention with a sliding window (keys fewer than `window` back) and/or ALiBi's
    per-head slopes: what training passes attention instead of a mask tensor."""
    window: int | None = None
    slopes: torch.Tensor | None = None


def _one_process_blocks(q, window, slopes, chunk):
    chunks = one_process_chunks(q.shape[2], window, chunk)
    return blocks(chunks, chunks, window, slopes, q.dtype, q.device)


class _Blocked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, window, slopes, chunk):
        acc, scale, kernel = torch.promote_types(q.dtype, torch.float32), 1.0 / math.sqrt(q.shape[-1]), kernel_for(q)
        out, lse = empty_output(q, acc)
        keys, values = (keys_for(kernel, t, q.shape[1]) for t in (k, v))
        attend(q, keys, values, _one_process_blocks(q, window, slopes, chunk), out, lse, kernel, scale)
        result = as_flash_output(out, q.dtype)
        ctx.mask, ctx.kernel, ctx.scale = (window, slopes, chunk), kernel, scale
        # what FlashAttention keeps: the inputs, the output, one log-sum-exp per query (the blocks'
        # masks are made again in backward)
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):
            q, k, v, out, lse = ctx.saved_tensors
            keys, values = (keys_for(ctx.kernel, t, q.shape[1]) for t in (k, v))
            dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
            dkv = torch.zeros((2, *keys.shape), dtype=lse.dtype, device=q.device)
            add_block_gradients(grad_out.contiguous(), q, keys, values, out, lse, _one_process_blocks(q, *ctx.mask),
                                ctx.kernel, ctx.scale, dq, dkv)
            dk, dv = (to_kv_heads(t, k.shape[1]) for t in dkv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def causal_attention(q, k, v, mask: CausalMask | None, chunk: int | None = None):
    """Causal attention, (batch, heads, L, d) queries and (batch, kv_heads, L, d) keys and values:
    SDPA's causal kernel, or with a window or ALiBi the blocks some query sees (`chunk`: the
    chunks' length, for tests)."""
    if mask is None or (mask.slopes is None and (mask.window is None or mask.window >= q.shape[2])):
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=q.shape[1] != k.shape[1])
    q, k, v = as_attention_computes(q, k, v)
    with torch.autocast(q.device.type, enabled=False):  # the blocks' arithmetic is chosen here
        return _Blocked.apply(q, k, v, mask.window, mask.slopes, chunk)
