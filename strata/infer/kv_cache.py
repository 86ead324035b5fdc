"""The key/value cache: every block's keys and values for a batch of sequences, preallocated for
the longest answer, filled in place as tokens are generated.

Prompts of different lengths are left-padded to one length (the slots before a row's prompt are
padding): every row then writes its next token to the same slot, so one forward serves the whole
batch. A row's position is its slot minus its padding; attention never lets a real token see a
padding slot (`attention_bias`)."""

from __future__ import annotations

import torch


class LayerKVCache:
    """One block's view of the cache: writes this forward's keys and values at the cache's fill
    position and returns everything filled so far."""

    def __init__(self, cache: "KVCache", index: int):
        self.cache, self.index = cache, index

    @property
    def pos(self) -> int:
        return self.cache.pos

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.cache.pos, self.cache.pos + k.shape[2]
        keys, values = self.cache.keys[self.index], self.cache.values[self.index]
        if end > keys.shape[2]:
            raise ValueError(f"KV cache holds {keys.shape[2]} positions; asked for {end}")
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        return keys[:, :, :end], values[:, :, :end]


class KVCache:
    """Keys and values of each block a model (or a pipeline stage) holds, (batch, kv_heads,
    max_len, head_dim) each. `pos` is the number of slots filled; `pad[row]` the padding slots
    before row's prompt (None: no row is padded)."""

    def __init__(self, model, batch: int, max_len: int, pad: torch.Tensor | None = None):
        self.keys, self.values = [], []
        for block in model.layers().values():
            keys, values = block.empty_kv_cache(batch, max_len)
            self.keys.append(keys)
            self.values.append(values)
        self.layers = [LayerKVCache(self, i) for i in range(len(self.keys))]
        self.max_len, self.pos = max_len, 0
        self.pad = pad if pad is not None and bool(pad.any()) else None

    def __getitem__(self, i: int) -> LayerKVCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    def advance(self, n: int) -> None:
        """n more slots are filled (called by the model once every block has written them)."""
        self.pos += n

    def positions(self, n: int) -> torch.Tensor | None:
        """(batch, n) positions of the next n slots of each row; None when no row is padded (the
        positions are then pos .. pos + n - 1 for every row)."""
        if self.pad is None:
            return None
        slots = torch.arange(self.pos, self.pos + n, device=self.pad.device)
        return (slots[None, :] - self.pad[:, None]).clamp(min=0)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
