"""What one pipeline rank of a layout holds at its peak, by kind (weights, gradients, optimizer
states, activations, buffers, and an asynchronous schedule's weight versions): the memory half of
the cost model (strata/plan/cost.py prices the time). What a rank holds apart from its activations
depends on its stage's load alone, so it is worked out once per distinct load; the ranks differ in
the micro-batches they hold in flight (rules/schedules.py's simulated schedule) and weight versions.
Every term and its source: docs/cost-model.md."""

from __future__ import annotations

from dataclasses import dataclass

from strata.model.config import ModelConfig
from strata.plan.buckets import collective_parts, staged
from strata.plan.data_parallel import BYTES
from strata.plan.experts import expert_group, expert_share, held_states
from strata.plan.memory import ModelStates, head_bytes, hpz_bytes, pipelined_zero_bytes
from strata.plan.stages import StageLoad, micro_batches_in_flight, micro_batches_in_flight_by_rank
from strata.plan.tensor import buffer_bytes, params_held
from strata.plan.terms import Terms
from strata.plan.workload import Workload, bucket_mb_for
from strata.rules.layout import Layout
from strata.rules.schedules import SCHEDULES, ScheduleSpec


def peak_rank_memory(work: Workload, lay: Layout, terms: Terms, loads: tuple[StageLoad, ...],
                      distinct: tuple[StageLoad, ...], stage_of_rank: tuple[int, ...]) -> dict[str, float]:
    """The memory by kind of the pipeline rank that holds the most (the first of them, where
    several do). What a rank holds besides its activations depends on its load alone, so it is
    worked out once per distinct load (plan/stages.distinct_stages); a rank then adds its micro-
    batches in flight (one look-up of the simulated schedule for all ranks) and weight versions.
    Each rank's total is summed as sum(memory.values()) would sum it, in the same order, so the
    rank chosen is the one a max over every rank's dict chooses; only its dict is built."""
    spec = SCHEDULES[lay.schedule]
    in_flight = micro_batches_in_flight_by_rank(lay, terms.micro_batches)
    held: list[StageMemory | None] = [None] * len(distinct)
    peak_values, peak_total = (), 0.0
    for rank, load in enumerate(loads):
        index = stage_of_rank[rank]
        stage = held[index]
        if stage is None:
            stage = held[index] = stage_memory(work, lay, terms, load)
        values = rank_memory_values(lay, terms, spec, rank, load, in_flight[rank], stage)
        total = sum(values)
        if rank == 0 or total > peak_total:  # max()'s rule: a later rank replaces only when larger
            peak_values, peak_total = values, total
    return dict(zip(memory_kinds(spec), peak_values))


def rank_memory(work: Workload, lay: Layout, terms: Terms, rank: int, load: StageLoad) -> dict[str, float]:
    """Bytes one pipeline rank holds at its peak, by kind."""
    spec = SCHEDULES[lay.schedule]
    in_flight = micro_batches_in_flight(lay, terms.micro_batches, rank)
    values = rank_memory_values(lay, terms, spec, rank, load, in_flight, stage_memory(work, lay, terms, load))
    return dict(zip(memory_kinds(spec), values))


def memory_kinds(spec: ScheduleSpec) -> tuple[str, ...]:
    """The kinds of a rank's memory, in the order its total adds them."""
    kinds = ("weights", "gradients", "optimizer_states", "activations", "buffers")
    return kinds + ("weight_versions",) if spec.asynchronous else kinds


@dataclass(frozen=True)
class StageMemory:
    """What every rank of a given load holds, whatever its micro-batches in flight: its states, its
    buffers, and the activations of the embedding's output (first stage) and of the head (last)."""
    weights: float
    gradients: float
    optimizer_states: float
    edge_activations: float
    buffers: float


def stage_memory(work: Workload, lay: Layout, terms: Terms, load: StageLoad) -> StageMemory:
    cfg, t = work.model, lay.tp
    states = held_stage_states(cfg, lay, load, terms.precision, terms.optimizer)
    split = t if lay.tp_mode != "1d" else 1  # the grid cuts the embedding's output too
    edge_activations = (terms.tokens * cfg.d_model * terms.act_bytes / split if load.first else 0) + \
        (head_bytes(cfg, lay, work.seq_len, terms.act_bytes, work.logits_chunk_bytes) if load.last else 0)
    weights, gradients = states.weights, states.grads
    optimizer_states = 0.0 if lay.offload != "none" else states.optimizer
    buffers = layout_buffers(cfg, lay, t, load, bucket_mb_for(work, lay)) + \
        pipelined_zero_bytes(lay.zero, lay.pp, lay.reshard_after_forward, load.params / t, lay.gather_dtype,
                             lay.reduce_dtype) + hpz_bytes(lay, load.params / t)
    if lay.tp_mode != "1d":
        buffers += buffer_bytes(cfg, lay.grid, terms.tokens, terms.act_bytes)
    if lay.offload_params != "none":  # the shards and their gradients wait in the tier; a unit's shard
        weights = gradients = 0.0  # is read in ahead of its gather (two at once)
        buffers += 2 * 4 * max(cfg.unit_params()) / t / lay.shards
    return StageMemory(weights, gradients, optimizer_states, edge_activations, buffers)


def rank_memory_values(lay: Layout, terms: Terms, spec: ScheduleSpec, rank: int, load: StageLoad,
                        in_flight: float, stage: StageMemory) -> tuple[float, ...]:
    """A rank's memory in memory_kinds' order: its stage's, with the activations of the micro-
    batches it holds at its peak."""
    activations = terms.activation_per_layer * load.layers * in_flight + stage.edge_activations
    if lay.offload_activations != "none":  # only the block being recomputed has its input back
        activations -= terms.activation_per_layer * (load.layers - 1)
    values = (stage.weights, stage.gradients, stage.optimizer_states, activations, stage.buffers)
    if spec.asynchronous:
        # The stashed copies of the stage's weights the layers compute with (parallel/pipeline/
        # versions.py): delay + 1 (2 for 2BW, p - rank for PipeDream) besides the optimizer's, in the
        # parameters' dtype (fp32 masters unless gathered in bf16).
        compute_bytes = 2 if lay.gather_dtype == "bf16" else 4
        values += (spec.versions(lay.pp, rank) * load.params / lay.tp * compute_bytes,)
    return values


def held_stage_states(cfg: ModelConfig, lay: Layout, load: StageLoad, precision: str, optimizer: str | float) -> ModelStates:
    """The model states of a stage's rank (the same for every rank of equal stages: peak_rank_memory
    asks once per distinct load). Not cached: a search asks once per layout and load, and hashing
    a layout for a cache that never hits costs more than the count."""
    return held_states(cfg, lay, params_held(cfg, lay, load.params, load.layers, load.first, load.last), load.moe_layers,
                       precision, optimizer)


def layout_buffers(cfg: ModelConfig, lay: Layout, t: int, load: StageLoad, bucket_mb: float) -> float:
    """What the layout adds besides states and activations.

    ZeRO-2: the staging buffers of full gradients it keeps for its buckets (in the reduce dtype;
    plan/buckets.staged): a mixture's experts, reduced over their own group, have their own.

    ZeRO-3: its gathered units (one in use, one prefetched, in the gather dtype) and one unit's
    staged gradients (in the reduce dtype), at the size of the largest unit (the embedding or the
    head, for most models); with tied embeddings the embedding stays gathered from its forward to
    the head's backward as well."""
    if lay.zero == 2:
        dense, experts = expert_share(cfg, lay, load.params / t, load.moe_layers)
        split = False if experts else None
        # each bucket as the runtime pads it: aligned, a multiple of its group's shards
        held = staged(collective_parts(cfg, lay, load.layers, load.first, load.last, split, dense, bucket_mb))
        if experts and expert_group(lay)[0] > 1:  # (a group of one rank: ZeRO-0, nothing staged)
            held += staged(collective_parts(cfg, lay, load.layers, load.first, load.last, True, experts, bucket_mb))
        return held * BYTES[lay.reduce_dtype]
    if lay.zero < 3:
        return 0.0
    embedding, block, head = cfg.unit_params()
    largest = max(embedding, block, head) / t
    tied = embedding / t * BYTES[lay.gather_dtype] if cfg.tie_embeddings else 0.0
    return largest * (2 * BYTES[lay.gather_dtype] + BYTES[lay.reduce_dtype]) + tied
