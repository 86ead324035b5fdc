"""The pipeline's stages as the cost model sees them: what each pipeline rank holds and computes
(strata's own cut, rules/pipeline_cut.py), the micro-batches whose activations it keeps, and the
bubble, both from the simulated schedule (rules/schedules.py). The estimate: plan/cost.py."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from strata.model.config import ModelConfig
from strata.rules.layout import Layout
from strata.rules.pipeline_cut import make_layout
from strata.rules.schedules import profile


@dataclass(frozen=True)
class StageLoad:
    """What one pipeline rank holds and computes (all its chunks together)."""
    params: float
    layers: int  # transformer blocks
    first: bool  # holds the embedding
    last: bool  # holds the head (and the loss)
    moe_layers: int = 0  # of its blocks, those with the mixture (DeepSeek's first ones are dense)


@lru_cache(maxsize=512)
def stage_loads(cfg: ModelConfig, p: int, v: int, seq_len: int) -> tuple[StageLoad, ...]:
    """Per pipeline rank, from strata's own cut (balanced by forward FLOPs: the embedding with the
    first chunk, the head with the last), so an uneven stage costs what it costs."""
    embed, _, head = cfg.unit_params()
    per_layer = cfg.layer_params()
    if p == 1:
        layers_of_rank = [range(cfg.n_layers)]
    else:
        layout = make_layout(cfg, p, v, seq_len, None)
        layers_of_rank = [[i for c in layout.chunks_of(r) for i in layout.blocks_of(c)] for r in range(p)]
    loads = []
    for rank, layers in enumerate(layers_of_rank):
        first, last, blocks = rank == 0, rank == p - 1, len(layers)
        params = sum(per_layer[i] for i in layers) + (embed if first else 0) + (head if last else 0)
        if last and not first and cfg.tie_embeddings:
            params += cfg.vocab_size * cfg.d_model  # the last stage's copy of the tied embedding
        loads.append(StageLoad(params, blocks, first, last, sum(cfg.layer_is_moe(i) for i in layers)))
    return tuple(loads)


@lru_cache(maxsize=512)
def distinct_stages(cfg: ModelConfig, p: int, v: int, seq_len: int) -> tuple[tuple[StageLoad, ...], tuple[int, ...]]:
    """stage_loads' distinct loads, in the order the ranks first hold them, and for each rank the
    index of its load among them: a deep pipeline's middle stages are equal, so what depends on the
    load alone (its time, what it holds whatever its micro-batches in flight) is worked out once
    per distinct load, without hashing every rank's load in every estimate."""
    loads = stage_loads(cfg, p, v, seq_len)
    distinct = list(dict.fromkeys(loads))
    return tuple(distinct), tuple(distinct.index(load) for load in loads)


def micro_batches_in_flight_by_rank(lay: Layout, m: int) -> tuple[float, ...]:
    """Micro-batches whose activations each pipeline rank holds at its peak, from one look-up of
    strata's own schedule, simulated (GPipe all m; 1F1B p - rank; ZB-H1 p, its weight gradients
    hold them longer; interleaving about 1 + (p-1)/(p·v) times 1F1B's, Narayanan et al. 2021)."""
    if lay.pp == 1:
        return (1,)
    return profile(lay.schedule, lay.pp, m, lay.virtual_stages).in_flight


def micro_batches_in_flight(lay: Layout, m: int, rank: int) -> float:
    """micro_batches_in_flight_by_rank's answer for pipeline rank `rank`."""
    return micro_batches_in_flight_by_rank(lay, m)[rank]


def bubble_seconds(lay: Layout, m: int, per_micro_batch: float) -> float:
    """Idle time of a step beyond the work of m micro-batches, from the simulated schedule: (p-1)
    micro-batch slots for GPipe and 1F1B, /v interleaved, about a third of it for ZB-H1, each slot
    `per_micro_batch` long."""
    if lay.pp == 1:
        return 0.0
    return profile(lay.schedule, lay.pp, m, lay.virtual_stages).bubble_slots * per_micro_batch
