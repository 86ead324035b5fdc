"""Cutting a model into pipeline chunks: pure arithmetic over its shape, shared by the runtime
(strata/parallel/pipeline/stage.py keeps each rank's layers), the layout check and the planner.

The model is a list of units (rules/units.py): the embedding, the blocks, and the head (final
norm, output projection, loss). The p·v chunks are contiguous runs of units (chunk c on rank c % p); by default
they are balanced by forward FLOPs (the most expensive chunk is as cheap as it can be), or the
user gives the number of blocks per chunk (`pp_split`). The embedding is always on chunk 0 and
the head on the last chunk."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from strata.errors import ConfigError
from strata.model.config import ModelConfig
from strata.rules.units import unit_count


@dataclass(frozen=True)
class PipelineLayout:
    stages: int  # p
    virtual_stages: int  # v: chunks per rank
    blocks_per_chunk: tuple[int, ...]  # p·v entries summing to n_layers

    @property
    def num_chunks(self) -> int:
        return self.stages * self.virtual_stages

    def chunks_of(self, pp_rank: int) -> list[int]:
        return list(range(pp_rank, self.num_chunks, self.stages))

    def rank_of(self, chunk: int) -> int:
        return chunk % self.stages

    def blocks_of(self, chunk: int) -> range:
        start = sum(self.blocks_per_chunk[:chunk])
        return range(start, start + self.blocks_per_chunk[chunk])


def unit_costs(cfg: ModelConfig, seq_len: int) -> list[float]:
    """Forward FLOPs per token of each unit: embedding (a lookup: ~d), each block (its matmuls and
    attention scores), head (the vocabulary projection)."""
    d, attention = cfg.d_model, 2 * cfg.attention_products(seq_len) / cfg.n_layers
    if cfg.uniform_layers:
        blocks = [float(2 * cfg.block_matmul_params() + attention)] * cfg.n_layers
    else:  # DeepSeek's dense first layers against its mixtures
        blocks = [float(2 * cfg.block_matmul_params(i) + attention) for i in range(cfg.n_layers)]
    return [float(d)] + blocks + [2.0 * d * cfg.vocab_size]


def balanced_split(costs: list[float], parts: int) -> list[int]:
    """Cut `costs` into `parts` contiguous non-empty runs minimising the largest run's sum; returns
    the length of each run. Exact dynamic programme (units are few)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]  # best[k][i]: first i units in k runs
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-9 * abs(value):  # ties: the earliest cut (fewer units early)
                    best[k][i], cut[k][i] = value, j
    lengths, i = [], n
    for k in range(parts, 0, -1):
        lengths.append(i - cut[k][i])
        i = cut[k][i]
    return lengths[::-1]


@lru_cache(maxsize=1024)
def make_layout(cfg: ModelConfig, stages: int, virtual_stages: int, seq_len: int,
                split: str | None = None) -> PipelineLayout:
    """The chunking for --pp, --virtual-stages and (optionally) --pp-split "n0,n1,...": blocks
    per chunk. Raises ConfigError when the model cannot be cut that way."""
    chunks = stages * virtual_stages
    if split:
        try:
            counts = tuple(int(x) for x in split.split(","))
        except ValueError:
            raise ConfigError("give blocks per chunk as integers, e.g. 3,3", "pp_split", split) from None
        if len(counts) != chunks or sum(counts) != cfg.n_layers or min(counts) < 0:
            raise ConfigError(f"needs {chunks} counts (pp x virtual stages) >= 0 summing to the model's "
                              f"{cfg.n_layers} layers", "pp_split", split)
        if any(c == 0 for c in counts[1:-1]):
            raise ConfigError("only the first and last chunk may hold no blocks (they hold the embedding and "
                              "the head)", "pp_split", split)
        return PipelineLayout(stages, virtual_stages, counts)
    units = unit_count(cfg.n_layers)
    if chunks > units:
        raise ConfigError(f"with {virtual_stages} virtual stage(s), {chunks} chunks, but the model has only "
                          f"{cfg.n_layers} layers + embedding + head = {units} units to split", "pp", stages)
    lengths = balanced_split(unit_costs(cfg, seq_len), chunks)
    counts, start = [], 0
    for length in lengths:  # unit u is the embedding (0), block u-1, or the head (n_layers + 1)
        blocks = [u - 1 for u in range(start, start + length) if 1 <= u <= cfg.n_layers]
        counts.append(len(blocks))
        start += length
    return PipelineLayout(stages, virtual_stages, tuple(counts))
