"""What a rank's data-parallel collectives carry, as the runtime cuts them: ZeRO-0/1/2 one per
gradient bucket (the cut: strata/rules/buckets.py, over the rank's parameters back to front, in
--bucket-mb of the fp32 masters; each bucket as the runtime pads it, aligned on its dp ranks), ZeRO-3
one per unit (strata/rules/units.py).

The bucket cut depends on the parameters' sizes and order: a parameter larger than a bucket gets
one of its own, and so does a norm between two such. So the planner lists a model's parameters in
the order the model registers them (tests/test_plan_buckets.py compares the list with the model's
own), and cuts a rank's share of them: under tensor parallelism each parameter in proportion to
what the rank holds (plan/tensor.params_held)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from functools import lru_cache

from strata.model.config import ModelConfig
from strata.plan.experts import expert_group
from strata.plan.memory import powersgd_fractions
from strata.rules.buckets import bucket_elements, bucket_fills, in_flight_limit
from strata.rules.compression import onebit_rows, onebit_units
from strata.rules.dtypes import DTYPES
from strata.rules.layout import Layout
from strata.rules.units import unit_count

MASTER_BYTES = DTYPES["fp32"].bytes  # what the runtime's buckets hold: the fp32 master parameters


def _linear(inputs: int, outputs: int, bias: bool) -> list[int]:
    return [inputs * outputs] + ([outputs] if bias else [])


def _norm(cfg: ModelConfig, width: int) -> list[int]:
    return [width] * (2 if cfg.norm == "layernorm" else 1)  # a weight, and LayerNorm's bias


def block_parameters(cfg: ModelConfig, layer: int | None = None) -> list[tuple[int, bool]]:
    """(elements, whether a routed expert's) of block `layer`'s parameters, in the model's order: the
    model's own list (ModelConfig.block_parameter_shapes: the shared block's, or a family's own); a
    routed expert's is the only stacked (3-D) tensor of a block. Without a layer, the last one's
    (where blocks differ by layer, DeepSeek's dense first ones, a stage's buckets are scaled to its
    own parameters after)."""
    return [(math.prod(shape), len(shape) == 3)
            for _, shape in cfg.block_parameter_shapes(cfg.n_layers - 1 if layer is None else layer)]


def input_parameters(cfg: ModelConfig) -> list[int]:
    """The embedding, learned positions and the embedding's norm, as the model has them."""
    d = cfg.d_model
    return [cfg.vocab_size * d] + ([cfg.max_seq_len * d] if cfg.position == "learned" else []) + \
        (_norm(cfg, d) if cfg.embedding_norm else [])


def output_parameters(cfg: ModelConfig) -> list[int]:
    """The final norm and the head (none when tied: it reads the embedding)."""
    return _norm(cfg, cfg.d_model) + ([] if cfg.tie_embeddings else _linear(cfg.d_model, cfg.vocab_size, cfg.bias))


@dataclass(frozen=True)
class Parts:
    """The parameters each collective of one kind carries, in the order the runtime issues them."""
    sizes: tuple[tuple[float, int], ...]  # (elements, padded, how many collectives carry that many)
    last: float  # the last one's: ZeRO-0/1/2's bucket that backward completes last
    # --compress powersgd: (the P round's, the Q round's) elements per element of a bucket, and the
    # share of the elements in compressed matrices (rules/compression.py); None: sent whole
    compressed: tuple[float, float, float] | None = None
    # --compress onebit/zeroone: the scales in each row of its collectives (the most pieces of
    # tensors a chunk of the flat model holds: rules/compression.onebit_pieces)
    scales: int = 1

    @property
    def count(self) -> int:
        return sum(n for _, n in self.sizes)


def held_parameters(cfg: ModelConfig, layers: int, first: bool, last: bool) -> list[tuple[int, bool]]:
    """(elements, whether a routed expert's) of a pipeline rank's parameters in the model's order:
    the inputs when `first`, its `layers` blocks, the outputs when `last` (and a tied embedding's
    copy)."""
    return [(size, False) for size in (input_parameters(cfg) if first else []) +
            ([cfg.vocab_size * cfg.d_model] if last and not first and cfg.tie_embeddings else [])] + \
        block_parameters(cfg) * layers + [(size, False) for size in (output_parameters(cfg) if last else [])]


@lru_cache(maxsize=256)
def onebit_scales(cfg: ModelConfig, layers: int, dp_size: int, first: bool = True, last: bool = True) -> int:
    """1-bit Adam's scales per row on a pipeline rank (its `layers` blocks, the inputs when `first`,
    the outputs when `last`; the whole model by default): the most pieces of tensors in a chunk of
    its flat buffer. Beside a pipeline a tied embedding's copy is a segment of its own on the first
    and the last stage (padded and cut in dp chunks apart from the rest: parallel/onebit_adam.py), so
    a chunk holds its piece and the rest's. The embeddings (the tokens', learned positions', a tied
    copy) have a scale per row (rules/compression.onebit_units)."""
    sizes = [size for size, _ in held_parameters(cfg, layers, first, last)]
    # the embeddings lead a rank's parameters: the inputs' (input_parameters), or the tied copy
    embeddings = (2 if cfg.position == "learned" else 1) if first else int(cfg.tie_embeddings and last)
    units = [onebit_units(size, cfg.d_model if i < embeddings else None) for i, size in enumerate(sizes)]
    segments = [units[:1], units[1:]] if cfg.tie_embeddings and first != last else [units]
    return onebit_rows([[n for unit in segment for n in unit] for segment in segments], dp_size)[1]


@lru_cache(maxsize=1024)
def bucket_parts(cfg: ModelConfig, layers: int, first: bool, last: bool, experts: bool | None,
                 params: float, bucket_mb: float, dp_size: int = 1) -> Parts:
    """A pipeline rank's gradient buckets: its `layers` blocks, the inputs when `first`, the
    outputs when `last` (and a tied embedding's copy), back to front, cut in --bucket-mb buckets.
    experts: only the routed experts (True), all but them (False), or every parameter (None).
    `params`: what the rank holds of them (its shares under tensor and expert parallelism), which
    the buckets' parameters add up to; each bucket padded as the runtime aligns it on `dp_size`
    ranks (what its collectives move)."""
    sizes = [size for size, expert in held_parameters(cfg, layers, first, last) if experts is None or expert == experts]
    if not sizes or params <= 0:
        return Parts(((0.0, 1),), 0.0)
    share = params / sum(sizes)
    fills = bucket_fills([size * share for size in reversed(sizes)], bucket_elements(bucket_mb, MASTER_BYTES),
                         dp_size, aligned=True)
    return Parts(tuple(Counter(fills).items()), fills[-1])


def unit_parts(layers: float, params: float, first: bool = True, last: bool = True) -> Parts:
    """ZeRO-3's collectives: one per unit a rank holds (its blocks, and the embedding's and the
    head's units on a pipeline's first and last stage), each priced at an equal share of the
    parameters."""
    units = unit_count(max(1, round(layers))) - (not first) - (not last)
    return Parts(((params / units, units),), params / units)


def collective_parts(cfg: ModelConfig, lay: Layout, layers: int, first: bool, last: bool, experts: bool | None,
                     params: float, bucket_mb: float) -> Parts:
    """What each of a rank's data-parallel collectives carries under its ZeRO stage."""
    if lay.zero == 3:
        return unit_parts(layers, params, first, last)
    group = expert_group(lay)[0] if experts else lay.shards  # the ranks a bucket is sharded over
    parts = bucket_parts(cfg, layers, first, last, experts, params, bucket_mb, group)
    if lay.compress == "powersgd":
        parts = replace(parts, compressed=powersgd_fractions(cfg, lay.compress_rank))
    elif lay.compress in ("onebit", "zeroone"):
        parts = replace(parts, scales=onebit_scales(cfg, layers, lay.shards, first, last))
    return parts



def staged(parts: Parts) -> float:
    """The parameters ZeRO-2's staging buffers hold: as many buffers as are staged at once (one
    filling while ZeRO-2's in-flight limit reduce, or every bucket when there are fewer), each the
    size of the largest bucket, as parallel/gradients.py's ShardGradients allocates them."""
    return min(parts.count, in_flight_limit(2, reduces_in_place=False) + 1) * max(size for size, _ in parts.sizes)
