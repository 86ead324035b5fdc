"""Deterministic (input, target) windows.

The windows of optimizer step k are a pure function of (seed, split, k): a generator seeded with
them draws `global_batch` window starts. Data-parallel rank r of N takes rows [r·B/N, (r+1)·B/N) of
that batch, so N ranks together see exactly the batch one process would, and resuming at step k
needs nothing but k."""

from __future__ import annotations

import os

import numpy as np
import torch

from strata.errors import ConfigError, CorruptError
from strata.files import inside, read_json_object

_SPLIT_ID = {"train": 0, "val": 1}


class TokenSource:
    """One split: a list of token arrays (memory-mapped shards, or an in-memory synthetic stream).
    A window never crosses a shard boundary."""

    def __init__(self, shards: list[np.ndarray], vocab_size: int):
        self.shards = [s for s in shards if len(s) > 0]
        self.vocab_size = vocab_size

    def window_starts(self, seq_len: int) -> np.ndarray:
        """Cumulative count of valid window starts per shard (a window is seq_len + 1 tokens)."""
        return np.cumsum([max(len(s) - seq_len, 0) for s in self.shards])

    def window(self, index: int, seq_len: int, cumulative: np.ndarray) -> np.ndarray:
        shard = int(np.searchsorted(cumulative, index, side="right"))
        offset = index - (int(cumulative[shard - 1]) if shard else 0)
        return np.asarray(self.shards[shard][offset:offset + seq_len + 1], dtype=np.int64)


DTYPES = ("uint16", "uint32")  # what `strata data prepare` writes
SCAN_TOKENS = 1 << 24  # token ids checked per read, to keep the scan's memory flat


def read_meta(data_dir: str) -> dict:
    """A prepared data directory's meta.json, checked against the files: every shard a plain name
    inside the directory, present, with exactly the bytes its token count needs, and the split
    totals the sum of their shards. Raises one line naming the first problem."""
    meta_path = os.path.join(data_dir, "meta.json")
    if not os.path.isfile(meta_path):
        raise ConfigError(f"--data {data_dir}: no meta.json; run `strata data prepare --out {data_dir}` "
                          f"first, or use --data synthetic")
    meta = read_json_object(meta_path, "what `strata data prepare` writes")
    try:
        _check_meta(meta, data_dir, meta_path)
    except KeyError as e:
        raise CorruptError(f"{meta_path}: has no {e.args[0]!r}; not what `strata data prepare` writes") from None
    except (TypeError, AttributeError) as e:
        raise CorruptError(f"{meta_path}: not what `strata data prepare` writes ({e})") from None
    return meta


def _check_meta(meta: dict, data_dir: str, meta_path: str) -> None:
    vocab = meta["vocab_size"]
    if not isinstance(vocab, int) or vocab < 2:
        raise CorruptError(f"{meta_path}: vocab_size {vocab!r} must be a whole number >= 2")
    if meta["dtype"] not in DTYPES:
        raise CorruptError(f"{meta_path}: dtype {meta['dtype']!r}; valid: {', '.join(DTYPES)}")
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in ("train", "val"):
        entry = meta["splits"][split]
        total = 0
        for shard in entry["shards"]:
            path = inside(data_dir, shard["file"], meta_path)
            tokens = shard["tokens"]
            if not isinstance(tokens, int) or tokens < 0:
                raise CorruptError(f"{meta_path}: {shard['file']} has token count {tokens!r}")
            if not os.path.isfile(path):
                raise CorruptError(f"--data {data_dir}: shard {shard['file']} is missing")
            size = os.path.getsize(path)
            if size != tokens * itemsize:
                raise CorruptError(f"--data {data_dir}: shard {shard['file']} has {size} bytes; meta.json's "
                                   f"{tokens} {meta['dtype']} tokens need {tokens * itemsize} (truncated or replaced)")
            total += tokens
        if total != entry["tokens"]:
            raise CorruptError(f"{meta_path}: the {split} split counts {entry['tokens']} tokens, its shards {total}")


def check_token_ids(data_dir: str, meta: dict) -> None:
    """Every token id of every shard is inside the vocabulary (one pass over the files)."""
    for split in ("train", "val"):
        for shard in meta["splits"][split]["shards"]:
            if shard["tokens"] == 0:
                continue
            ids = np.memmap(os.path.join(data_dir, shard["file"]), dtype=meta["dtype"], mode="r")
            for start in range(0, len(ids), SCAN_TOKENS):
                largest = int(ids[start:start + SCAN_TOKENS].max())
                if largest >= meta["vocab_size"]:
                    raise CorruptError(f"--data {data_dir}: shard {shard['file']} holds token id {largest}, "
                                       f"outside the vocabulary of {meta['vocab_size']}")


def _no_window(split: str, seq_len: int) -> ConfigError:
    return ConfigError(f"the {split} split is shorter than one window of seq_len + 1 tokens; use a shorter "
                       f"seq_len or more text", "seq_len", seq_len)


def check_windows(meta: dict, seq_len: int) -> None:
    """Both splits of a prepared data set hold at least one window (a window never crosses shards)."""
    for split in ("train", "val"):
        if not any(shard["tokens"] > seq_len for shard in meta["splits"][split]["shards"]):
            raise _no_window(split, seq_len)


def open_split(data_dir: str, split: str) -> TokenSource:
    """Memory-map the shards of `split` written by `strata data prepare`."""
    meta = read_meta(data_dir)
    shards = [np.memmap(os.path.join(data_dir, s["file"]), dtype=meta["dtype"], mode="r")
              for s in meta["splits"][split]["shards"] if s["tokens"] > 0]
    return TokenSource(shards, meta["vocab_size"])


def synthetic_split(vocab_size: int, seed: int, split: str, tokens: int = 1 << 18) -> TokenSource:
    """Deterministic tokens with structure a model can learn: each token is followed by a fixed
    successor three times in four, otherwise by a random token."""
    rng = np.random.default_rng([seed, 7919, _SPLIT_ID[split]])
    successor = np.random.default_rng([seed, 104729]).permutation(vocab_size)
    noise = rng.integers(0, vocab_size, size=tokens)
    follow = rng.random(tokens) < 0.75
    stream = np.empty(tokens, dtype=np.int64)
    stream[0] = noise[0]
    for i in range(1, tokens):  # a short loop over a fixed-size stream, once per run
        stream[i] = successor[stream[i - 1]] if follow[i] else noise[i]
    return TokenSource([stream], vocab_size)


class BatchLoader:
    """This rank's rows of each step. device: where micro_batches() hands them out; on an
    accelerator each step's tokens are copied from pinned host memory without the host waiting (a
    copy from pageable memory is a host sync), one step ahead: the next step's copy is queued as a
    step's batch is taken."""

    def __init__(self, source: TokenSource, seq_len: int, global_batch: int, seed: int,
                 split: str = "train", dp_rank: int = 0, dp_size: int = 1, device: torch.device | None = None):
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by dp size {dp_size}")
        self.source, self.seq_len, self.global_batch = source, seq_len, global_batch
        self.seed, self.split_id = seed, _SPLIT_ID[split]
        self.dp_rank, self.rows_per_rank = dp_rank, global_batch // dp_size
        self.cumulative = source.window_starts(seq_len)
        self.device = device if device is not None and torch.device(device).type != "cpu" else None
        self.ahead: dict[int, torch.Tensor] = {}  # step -> its tokens on the device, copy queued
        if len(self.cumulative) == 0 or self.cumulative[-1] == 0:
            raise _no_window(split, seq_len)

    def global_window_indices(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.split_id, step])
        return rng.integers(0, int(self.cumulative[-1]), size=self.global_batch)

    def tokens(self, step: int) -> torch.Tensor:
        """This rank's windows of step `step`, (rows, seq_len + 1) int64 in host memory."""
        indices = self.global_window_indices(step)
        mine = indices[self.dp_rank * self.rows_per_rank:(self.dp_rank + 1) * self.rows_per_rank]
        return torch.from_numpy(np.stack([self.source.window(int(i), self.seq_len, self.cumulative) for i in mine]))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of step `step`: (inputs, targets), each (rows, seq_len) int64, on the host."""
        tokens = self.tokens(step)
        return tokens[:, :-1], tokens[:, 1:]

    def _on_device(self, step: int) -> torch.Tensor:
        """Step `step`'s tokens on the device (queued a step ahead), and the next step's copy queued.
        The pinned source may be dropped at once: torch's pinned-memory allocator records the copy
        on its block and reuses the block only once the copy is done."""
        tokens = self.ahead.pop(step, None)
        if tokens is None:
            tokens = self.tokens(step).pin_memory().to(self.device, non_blocking=True)
        self.ahead = {step + 1: self.tokens(step + 1).pin_memory().to(self.device, non_blocking=True)}
        return tokens

    def micro_batches(self, step: int, micro_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of step `step`, (inputs, targets) each, on the loader's device."""
        if self.device is None:
            inputs, targets = self.batch(step)
        else:
            tokens = self._on_device(step)
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
        return [(inputs[i:i + micro_batch], targets[i:i + micro_batch])
                for i in range(0, len(inputs), micro_batch)]
