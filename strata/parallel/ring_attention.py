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

The blocks, their kernels (fused on the CPU and on CUDA) and the merge are
strata/model/attention_blocks.py's, which one process's windowed and ALiBi attention uses too."""

from __future__ import annotations

import math

import torch

from strata.distributed import comm
from strata.model.attention_blocks import (
    add_block_gradients,
    as_attention_computes,
    as_flash_output,
    attend,
    blocks,
    empty_output,
    kernel_for,
    keys_for,
    to_kv_heads,
)
from strata.rules.context import chunk_bounds

GROUP = "cp"


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


# --- the ring ------------------------------------------------------------------------------------
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


def _step_blocks(settings, step: int, dtype, device):
    source = (settings.axis.rank - step) % settings.axis.size
    return blocks(settings.chunks.bounds(), settings.chunks.bounds(source), settings.window, settings.slopes(), dtype,
                  device)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, settings):
        acc = torch.promote_types(q.dtype, torch.float32)  # bf16 blocks merge in fp32
        scale, kernel = 1.0 / math.sqrt(q.shape[-1]), kernel_for(q)
        out, lse = empty_output(q, acc)
        kv = torch.stack([k, v])  # one message per hop
        n = settings.axis.size
        for step in range(n):
            handle = None
            if step < n - 1:  # the next block travels while this one is attended to
                incoming, handle = _exchange(kv, settings)
            keys, values = (keys_for(kernel, t, q.shape[1]) for t in kv)
            attend(q, keys, values, _step_blocks(settings, step, q.dtype, q.device), out, lse, kernel, scale)
            _wait(handle)
            if step < n - 1:
                kv = incoming
        result = as_flash_output(out, q.dtype)
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
        acc, scale, kernel = lse.dtype, 1.0 / math.sqrt(q.shape[-1]), kernel_for(q)
        dout = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        n = settings.axis.size
        travelling = None  # the K/V gradient of the block before, on its way to its owner
        for step in range(n):
            handle = None
            if step < n - 1:
                incoming, handle = _exchange(kv, settings)
            keys, values = (keys_for(kernel, t, q.shape[1]) for t in kv)
            dkv = torch.zeros((2, *keys.shape), dtype=acc, device=q.device)
            add_block_gradients(dout, q, keys, values, out, lse, _step_blocks(settings, step, q.dtype, q.device),
                                kernel, scale, dq, dkv)
            dkv = torch.stack([to_kv_heads(t, k.shape[1]) for t in dkv])  # summed over the query heads reading it
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
    kernel = kernel or kernel_for(q)
    seq, heads = q.shape[2], q.shape[1]
    acc, scale = torch.promote_types(q.dtype, torch.float32), 1.0 / math.sqrt(q.shape[3])
    ranges = [chunk_bounds(seq, cp, r) for r in range(cp)]

    def keep(t, r):
        return torch.cat([t[:, :, a:b] for a, b in ranges[r]], dim=2)

    def put(whole, part, r):  # a rank's two chunks back at their places in the sequence
        half = part.shape[2] // 2
        for i, (a, b) in enumerate(ranges[r]):
            whole[:, :, a:b] += part[:, :, i * half:(i + 1) * half]

    keys = [keys_for(kernel, keep(k, r), heads) for r in range(cp)]
    values = [keys_for(kernel, keep(v, r), heads) for r in range(cp)]
    out_all, dq_all = (torch.zeros(q.shape, dtype=acc, device=q.device) for _ in range(2))
    dkv_all = torch.zeros((2, *keys[0].shape[:2], seq, q.shape[3]), dtype=acc, device=q.device)
    for r in range(cp):
        mine = keep(q, r)
        found = [list(blocks(ranges[r], ranges[source], window, slopes, q.dtype, q.device)) for source in range(cp)]
        out, lse = empty_output(mine, acc)
        for source in range(cp):
            attend(mine, keys[source], values[source], found[source], out, lse, kernel, scale)
        out = out.to(q.dtype)
        put(out_all, out.to(acc), r)
        dq = torch.zeros(mine.shape, dtype=acc, device=q.device)
        for source in range(cp):
            dkv = torch.zeros((2, *keys[source].shape), dtype=acc, device=q.device)
            add_block_gradients(keep(grad, r), mine, keys[source], values[source], out, lse, found[source], kernel,
                                scale, dq, dkv)
            put(dkv_all[0], dkv[0], source)
            put(dkv_all[1], dkv[1], source)
        put(dq_all, dq, r)
    dk_all, dv_all = (to_kv_heads(t, k.shape[1]) for t in dkv_all)
    return out_all.to(q.dtype), dq_all.to(q.dtype), dk_all.to(k.dtype), dv_all.to(v.dtype)
