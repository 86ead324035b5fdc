"""parallelize(): build the model for this rank's place in the layout and wrap it.

The order is fixed (torchtitan's, and the only one that composes): tensor parallelism swaps layers
on the meta-device model, pipeline parallelism keeps this rank's stage, torch.compile compiles the
forward of each block that remains and activation checkpointing wraps it (so recomputation runs the
compiled code; `selective` wraps the core attention inside the compiled forward instead; what runs
as module hooks, ZeRO-3's gathers and tensor parallelism's input conversions, stays outside the
compiled code), then the parameters are materialised, each
initialised from the logical parameter's seeded value and cut to this rank's slice, and data
parallelism / ZeRO wraps what is left."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from strata.config import TrainConfig, sequence_length
from strata.memory.checkpointing import apply_checkpointing
from strata.memory.offloaded_shards import OffloadedShards
from strata.memory.tiers import OffloadedActivations, Tier
from strata.model.config import ModelConfig
from strata.model.initial_values import initial_value
from strata.model.transformer import Transformer, build_model
from strata.parallel.context import apply_context_parallel
from strata.parallel.data import DataParallel, DataParallelSettings
from strata.parallel.expert import ExpertAxes, ExpertSplit, apply_expert_parallel, set_capacity
from strata.parallel.gradients import Replicate, ShardGradients, ShardOptimizerStates
from strata.parallel.onebit_adam import OnebitReplicate, OnebitShardStates
from strata.parallel.pipeline.stage import keep_stage, tied_copy
from strata.parallel.powersgd import PowerSGDReplicate
from strata.parallel.sharding import ShardingStrategy
from strata.parallel.tensor import apply_tensor_parallel, shard_specs
from strata.parallel.tensor_nd import GridGroups, apply_grid_parallel
from strata.parallel.zero3 import ShardParameters
from strata.rules.dtypes import torch_dtype
from strata.rules.pipeline_cut import PipelineLayout
from strata.rules.schedules import SCHEDULES

BUCKET_STAGES = {0: Replicate, 1: ShardOptimizerStates, 2: ShardGradients}  # ZeRO-3: ShardParameters


def parallelize(model_cfg: ModelConfig, cfg: TrainConfig, device: torch.device, dtype: torch.dtype,
                dp_group=None, tp_group=None, stage: tuple[PipelineLayout, int, object] | None = None,
                offload_dir: str | None = None, rank: int = 0, grid: GridGroups | None = None,
                experts: ExpertAxes | None = None, context=None,
                hybrid: tuple[object, object] | None = None, node=None) -> tuple[Transformer, DataParallel]:
    """stage: (the pipeline layout, this rank's stage, the pipeline process group), or None.
    offload_dir, rank: where and under which rank's name offloaded parameters and activations go.
    grid: this rank's place and sub-groups under 2-D, 2.5-D or 3-D tensor parallelism.
    experts: this rank's expert-parallel groups (with --ep > 1).
    context: this rank's context-parallel group (an Axis, with --cp > 1); dp_group is then the
    dp x cp ranks, over which the gradients are averaged.
    hybrid: hybrid sharding's (shard group, replica group): ZeRO shards over the first, and the
    gradient shards are all-reduced over the second.
    node: ZeRO++'s hpZ group (a mesh Axis, --hpz-partition-size), which ZeRO-3's backward gathers over."""
    lay = cfg.layout
    model = build_model(model_cfg, seed=None)  # meta device: nothing allocated yet
    if grid is not None:
        apply_grid_parallel(model, grid)
    elif tp_group is not None:
        apply_tensor_parallel(model, tp_group, lay.sequence_parallel)
    if context is not None:
        apply_context_parallel(model, context, lay.cp_mode, sequence_length(cfg, model_cfg))
    set_capacity(model, lay.capacity_factor)
    expert_names = apply_expert_parallel(model, experts) if experts is not None else set()
    if stage is not None:
        keep_stage(model, stage[0], stage[1])
        expert_names &= {name for name, _ in model.named_parameters()}  # this stage's
    if cfg.compile:
        compile_layers(model)
    # activations to host memory on a GPU; a CPU device's host memory is where they are: a file then
    activations = OffloadedActivations(Tier("disk" if device.type == "cpu" else "cpu", "activations", offload_dir,
                                            rank)) if lay.offload_activations != "none" else None
    apply_checkpointing(model, lay.checkpointing,
                        [stage[0].blocks_of(c) for c in stage[0].chunks_of(stage[1])] if stage is not None else None,
                        activations)
    init = local_initial_values(model, cfg.seed, tp_group, device)
    on_wire = {name: torch_dtype(value) if value != "fp32" else None
               for name, value in (("reduce_dtype", lay.reduce_dtype), ("gather_dtype", lay.gather_dtype))}
    settings = DataParallelSettings(dp_group, tp_group, stage[2] if stage is not None else None, cfg.bucket_mb,
                                    **on_wire)
    if hybrid is not None:
        settings = replace(settings, dp_group=hybrid[0], replica_group=hybrid[1], group_name="dp_shard")
    if lay.zero == 3:
        # Materialised one unit at a time, shard by shard: the full model never exists on a rank.
        offload = OffloadedShards(Tier(lay.offload_params, "params", offload_dir, rank)) \
            if lay.offload_params != "none" else None
        settings = replace(settings, keep_gathered=not lay.reshard_after_forward)
        sharding: ShardingStrategy = ShardParameters(model, settings, init, device, dtype, offload, node)
        tied = tied_copy(model, stage[0], stage[1]) if stage is not None else None  # the unit's parameter now
        settings = replace(settings, counted_elsewhere=frozenset({id(tied)} if tied is not None else ()))
    else:
        model = model.to_empty(device=device).to(dtype)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(init(name))
        tied = tied_copy(model, stage[0], stage[1]) if stage is not None else None
        settings = replace(settings, counted_elsewhere=frozenset({id(tied)} if tied is not None else ()))
        trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if expert_names:  # the experts' gradients reduced over the ranks holding the same experts
            settings = replace(settings, expert_ids=frozenset(id(p) for n, p in trainable if n in expert_names),
                               ep_group=experts.ep.group, edp_rank=experts.edp.rank)
            # (each expert on one rank, ep = dp: nothing to reduce nor shard)
            expert_stage = BUCKET_STAGES[lay.zero if experts.edp.group is not None else 0]
            sharding = ExpertSplit(
                BUCKET_STAGES[lay.zero]([p for n, p in trainable if n not in expert_names], settings),
                expert_stage([p for n, p in trainable if n in expert_names],
                             replace(settings, dp_group=experts.edp.group, group_name="edp")),
                expert_names)
        elif lay.compress == "powersgd":
            sharding = PowerSGDReplicate([p for _, p in trainable], settings, lay.compress_rank, lay.compress_after,
                                         cfg.seed, [name for name, _ in trainable])
        elif lay.compress in ("onebit", "zeroone"):
            # beside a pipeline, a tied embedding's copies (first and last stage) a segment of their own
            # (ZeRO-0 or ZeRO-1, the stage's buckets and update around the same compressed average)
            onebit_stage = OnebitShardStates if lay.zero == 1 else OnebitReplicate
            sharding = onebit_stage([p for _, p in trainable], settings, lay.compress_after,
                                    lay.var_update_scaler if lay.compress == "zeroone" else 0,
                                    model.tied_weight() if stage is not None else None,
                                    tuple(m.weight for m in model.modules() if isinstance(m, nn.Embedding)))
        else:
            sharding = BUCKET_STAGES[lay.zero]([p for _, p in trainable], settings)
        if SCHEDULES[lay.schedule].asynchronous and lay.zero == 0:  # weight stashing swaps the parameters' storage
            sharding.separate_optimizer_targets()
    model.init_state_buffers(device, dtype)
    model.reset_buffers()
    return model, DataParallel(model, sharding, settings, activations)


def compile_layers(model: Transformer) -> None:
    """torch.compile each block's forward. The blocks share their code, and torch.compile does not
    specialise on a module's identity (its parameters are inputs), so one compilation serves all."""
    for block in model.layers().values():
        block.forward = torch.compile(block.forward)


def compile_seconds() -> float | None:
    """Time torch.compile has spent tracing and generating code in this process (its own timers:
    the forward graphs, and the backward ones compiled lazily in the first backward); None before
    anything was compiled."""
    from torch._dynamo.utils import compilation_time_metrics  # private, but the only account it keeps
    parts = [sum(compilation_time_metrics.get(key, ())) for key in ("_compile.compile_inner", "backward._backward_impl")]
    return sum(parts) if any(parts) else None


def local_initial_values(model: Transformer, seed: int, tp_group, device):
    """init(name, flat=None) -> this rank's slice of the logical parameter's initial value
    (layout-independent), or the elements [flat[0], flat[1]) of it flattened (a ZeRO-3 shard's
    piece), made on `device` and nothing more."""
    specs = shard_specs(model)
    rank, world = (dist.get_rank(tp_group), dist.get_world_size(tp_group)) if tp_group is not None else (0, 1)

    def init(name: str, flat: tuple[int, int] | None = None) -> torch.Tensor:
        spec = specs[name]
        return initial_value(name, spec.full_shape, seed, model.cfg.n_layers, model.cfg.norm,
                             spec.local_box(rank, world), flat, device)
    return init
