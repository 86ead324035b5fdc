"""A preallocated key/value cache: one per transformer block, filled as tokens are generated."""

from __future__ import annotations

import torch


class LayerKVCache:
    """Keys and values of one attention layer, (batch, kv_heads, max_len, head_dim), written in
    place; `pos` is how many positions are filled."""

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        self.keys = torch.zeros(batch, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.pos = 0

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.pos + k.shape[2]
        if end > self.keys.shape[2]:
            raise ValueError(f"KV cache holds {self.keys.shape[2]} positions; asked for {end}")
        self.keys[:, :, self.pos:end] = k
        self.values[:, :, self.pos:end] = v
        self.pos = end
        return self.keys[:, :, :end], self.values[:, :, :end]


def make_caches(model, batch: int, max_len: int) -> list[LayerKVCache]:
    """One cache per block, sized from the block's own projections (so a tensor-parallel block
    holding a slice of the KV heads gets a cache of that slice)."""
    caches = []
    for block in model.blocks.values():
        attn = block.attn
        weight = attn.wk.weight
        with torch.no_grad():  # the projection's own output width, whatever layer implements it
            kv_heads = attn.wk(weight.new_zeros(1, 1, weight.shape[1])).shape[-1] // attn.head_dim
        caches.append(LayerKVCache(batch, kv_heads, max_len, attn.head_dim, weight.dtype, weight.device))
    return caches
