"""The cost model: memory, communication, compute and pipeline bubble of one layout, per device and
per optimizer step. Every term and its source is in docs/cost-model.md.

A layout's process groups follow strata's mesh order (tp innermost, then cp, then dp, then pp):
rank ((pp·dp_size + dp)·cp_size + cp)·tp_size + tp. So a tensor-parallel group is a run of adjacent
devices, inside a node when tp divides the devices per node; a context-parallel group is cp ranks
tp apart; the gradients' group (dp x cp ranks, plan/context.py) spans tp·dp·cp devices; pipeline
stages are the farthest apart. Each group's collectives run on the slowest link they cross."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from strata.model.config import ModelConfig
from strata.plan.buckets import collective_parts
from strata.plan.compute import StepWork, UnitSeconds, attention_flops, best_gemm_efficiency, fp8_flops, unit_seconds
from strata.plan.context import context_comm, extra_activation_bytes
from strata.plan.data_parallel import BYTES, data_parallel_seconds, gradient_pass_seconds, optimizer_seconds
from strata.plan.experts import (
    across_seconds,
    activation_change,
    all_to_all,
    expert_group,
    expert_share,
    moe_tp_collectives,
    updated_params,
)
from strata.plan.hardware import Device, Kernels
from strata.plan.links import Cluster, collective_seconds, core_split
from strata.plan.memory import activation_bytes_per_layer, device_overhead, optimizer_rate, overhead_note
from strata.plan.offload import offload_cost, offloads
from strata.plan.rank_memory import peak_rank_memory
from strata.plan.stages import StageLoad, bubble_seconds, distinct_stages, stage_loads
from strata.plan.tensor import element_bytes, grid_cost, overlapped_tp_seconds, params_held, stage_seconds
from strata.plan.terms import Terms
from strata.plan.workload import Estimate, Workload, bucket_mb_for
from strata.rules.layout import Layout
from strata.rules.pipeline_cut import unit_costs
from strata.rules.pipeline_wire import activation_wire_bytes


def log_interpolate(curve: tuple[tuple[float, float], ...], x: float) -> float:
    """y at x on a measured curve of (x, y) points sorted by x: linear in log(x) between points,
    the end values beyond them."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            return y0 + math.log(x / x0) / math.log(x1 / x0) * (y1 - y0)
    return curve[-1][1]


# --- the estimate ------------------------------------------------------------------------------
def estimate(work: Workload, cluster: Cluster, layout: Layout) -> Estimate:
    """The layout's memory and step time. On a machine whose processes share cores (cpu-local),
    a process computes faster while others wait (pipeline bubbles, stages with less work): the
    rate follows the average number of processes busy at once, found by a few rounds of
    fixed-point iteration."""
    kernels = cluster.device.kernels.with_attention(work.attention_kernel)
    if kernels is not cluster.device.kernels:  # the framework's attention kernel (Workload.attention_kernel)
        cluster = replace(cluster, device=replace(cluster.device, kernels=kernels))
    e = _estimate(work, cluster, layout, 1.0)
    if cluster.shared_cores:
        world = layout.world_size
        all_busy = core_split(world, cluster.shared_cores)
        for _ in range(4):
            active = max(1.0, world * min(1.0, e.busy_s / e.step_time_s))
            e = _estimate(work, cluster, layout, core_split(active, cluster.shared_cores) / all_busy)
    return e


def _terms(work: Workload, cluster: Cluster, lay: Layout, rate_scale: float) -> Terms:
    cfg, b, s, t = work.model, lay.micro_batch, work.seq_len, lay.tp
    act_bytes = BYTES["bf16" if work.precision in ("bf16", "fp16") else "fp32"]
    peak = cluster.device.peak_flops.get(work.precision, max(cluster.device.peak_flops.values()))
    fp8_peak = fp8_flops(cluster.device) if work.fp8 else None
    grid = lay.grid if lay.tp_mode != "1d" else None
    split = lay.sequence_parallel or grid is not None  # every activation between layers split t ways
    tokens = b * s // lay.cp  # a rank's part of the micro-batch: its 2 of 2·cp chunks of every sequence
    # context parallelism attends block by block (ring) or in one kernel per head group (Ulysses): fused
    fused = work.fused_attention or lay.cp > 1
    tp_message = tokens * cfg.d_model * act_bytes
    # the hidden states (and their gradients) in the dtype the runtime sends them in: one rule
    pp_message = tokens * cfg.d_model * activation_wire_bytes(work.precision) / (t if split else 1)
    step_work = StepWork(cfg, tokens, b, s, t, split, fused, act_bytes, grid, lay.ep)
    units, ceiling = _unit_seconds(step_work, cluster, peak, fp8_peak)
    # processes sharing cores (cpu-local): every kernel runs at the share of the cores it gets
    units = tuple(UnitSeconds(u.forward / rate_scale, u.backward / rate_scale, u.attention_forward / rate_scale)
                  for u in units)
    terms = dict(act_bytes=act_bytes, precision="mixed" if act_bytes == 2 else "fp32",
                 micro_batches=work.global_batch // (lay.dp * b), tokens=tokens, d_model=cfg.d_model, peak=peak,
                 units=units, kernel_ceiling=ceiling,
                 activation_per_layer=activation_bytes_per_layer(s // lay.cp, b, cfg.d_model, cfg.n_heads, t, split,
                                                                 lay.checkpointing, fused_attention=fused)
                 * act_bytes / 2
                 + activation_change(cfg, tokens, t, lay.checkpointing, act_bytes)
                 + extra_activation_bytes(cfg, lay, b * s, act_bytes),
                 tp_message=tp_message, pp_message=pp_message, optimizer=optimizer_rate(work.optimizer, cfg),
                 tp_overlap=work.tp_overlap and grid is None,
                 pp_send_s=collective_seconds(cluster, "send", pp_message, lay.pp, t * lay.replicas) / rate_scale
                 if lay.pp > 1 else 0.0)
    if grid is not None:
        e = element_bytes(lay, act_bytes, BYTES[lay.gather_dtype])
        return Terms(**terms, tp_collective_s=0.0, grid=grid_cost(cfg, grid, tokens, e, cluster))
    op = "all_gather" if lay.sequence_parallel else "all_reduce"
    moe_tp = [(n * collective_seconds(cluster, "all_reduce", nbytes, t, 1), n * 2 * (t - 1) / t * nbytes)
              for nbytes, n in moe_tp_collectives(cfg, tokens, act_bytes)] if t > 1 else []
    a2a = all_to_all(cfg, lay, cluster, tokens, act_bytes)
    block = units[1]
    return Terms(**terms, tp_collective_s=collective_seconds(cluster, op, tp_message, t, 1) / rate_scale, grid=None,
                  all_to_all=a2a, moe_tp=(sum(x for x, _ in moe_tp), sum(y for _, y in moe_tp)),
                  across=across_seconds(cfg, lay, cluster, tokens, act_bytes, a2a),
                  context=context_comm(cfg, lay, cluster, b * s, act_bytes, block.attention_forward,
                                       block.attention_backward))


def _unit_seconds(w: StepWork, cluster: Cluster, peak: float,
                  fp8_peak: float | None = None) -> tuple[tuple[UnitSeconds, ...], float]:
    """Each unit's seconds for one micro-batch and the kernels' best fraction of the peak: from
    the work's shapes (compute.py), or, with --efficiency, every FLOP at that fraction (of the
    clock a power cap leaves; the blocks' matmuls of the FP8 peak with fp8_peak)."""
    device = cluster.device
    if cluster.efficiency is None:
        return _kernel_seconds(w, device.kernels, peak, device.memory_bandwidth, fp8_peak)
    rate = peak * cluster.efficiency * device.kernels.clock_factor
    matmul_rate = rate if fp8_peak is None else fp8_peak * cluster.efficiency * device.kernels.clock_factor
    costs = unit_costs(w.model, w.seq_len)
    embedding, head = (w.tokens * flops / w.tp / rate for flops in (costs[0], costs[-1]))
    attention = attention_flops(w) / rate
    block = w.tokens * 2 * w.model.blocks_matmul_params() / w.model.n_layers / w.tp / matmul_rate + attention
    return (UnitSeconds(embedding, 2 * embedding, 0.0), UnitSeconds(block, 2 * block, attention),
            UnitSeconds(head, 2 * head, 0.0)), cluster.efficiency * device.kernels.clock_factor


@lru_cache(maxsize=1024)
def _kernel_seconds(w: StepWork, kernels: Kernels, peak: float, bandwidth: float,
                    fp8_peak: float | None) -> tuple[tuple[UnitSeconds, ...], float]:
    """unit_seconds and best_gemm_efficiency of one micro-batch's work on these kernels: the same
    for every layout of the same shapes (they differ in ZeRO stage, schedule, checkpointing,
    offload...), so worked out once for the thousands a search prices."""
    return unit_seconds(w, kernels, peak, bandwidth, fp8_peak), best_gemm_efficiency(w, kernels, peak, bandwidth, fp8_peak)


@dataclass(frozen=True)
class _RankTime:
    """One pipeline rank's time for one micro-batch: forward and backward (each with half of the
    communication), the compute alone, and its tensor-parallel collectives."""
    forward: float
    backward: float
    compute: float
    tp_seconds: float
    tp_bytes: float  # a rank sends over the tensor-parallel groups
    tp_step_seconds: float  # once a step: the sums of partial gradients over tensor-parallel groups
    tp_step_bytes: float
    load: StageLoad
    ep_seconds: float = 0.0  # a mixture's all-to-alls (plan/experts.py), on the critical path
    ep_bytes: float = 0.0
    cp_seconds: float = 0.0  # context parallelism's traffic (plan/context.py), hidden or not
    cp_exposed: float = 0.0  # of it, what the attention does not hide (in forward and backward)
    cp_bytes: float = 0.0
    tp_exposed: float | None = None  # of tp_seconds, what the GEMMs do not hide (None: all of it)

    @property
    def total(self) -> float:
        return self.forward + self.backward


def _rank_time(cluster: Cluster, lay: Layout, terms: Terms, load: StageLoad) -> _RankTime:
    p = lay.pp
    embedding, block, head = terms.units
    units = ((embedding, load.first), (block, load.layers), (head, load.last))
    fwd = sum(unit.forward * count for unit, count in units)
    bwd = sum(unit.backward * count for unit, count in units)
    # full: the blocks' forward again (strata checkpoints blocks; the embedding and head are not recomputed)
    recompute = {"none": 0.0, "selective": block.attention_forward, "full": block.forward}[lay.checkpointing] * load.layers
    tp_seconds, tp_bytes, step_seconds, step_bytes = stage_seconds(cluster, lay, terms.grid, terms.tp_collective_s,
                                                                   terms.tp_message, terms.tokens, terms.d_model,
                                                                   load.layers, load.first, load.last)
    tp_seconds += load.layers * terms.moe_tp[0]
    tp_bytes += load.layers * terms.moe_tp[1]
    # on the critical path: all of it, or with overlap what the GEMMs do not hide
    tp_path = overlapped_tp_seconds(tp_seconds, fwd + bwd + recompute, lay.tp) if terms.tp_overlap else tp_seconds
    pp_seconds = 2 * lay.virtual_stages * terms.pp_send_s * (p > 1)
    # the all-to-alls: half in the forward, half in the backward, the forward's again when recomputed
    a2a, full = terms.all_to_all, lay.checkpointing == "full"
    ep_fwd, ep_bwd = load.layers * a2a.forward_seconds, load.layers * (a2a.seconds - a2a.forward_seconds)
    ep_again = ep_fwd if full else 0.0
    cp = terms.context  # per attention layer, recomputation's included
    return _RankTime(fwd + (tp_path + pp_seconds) / 2 + ep_fwd + load.layers * cp.forward_exposed,
                     bwd + recompute + (tp_path + pp_seconds) / 2 + ep_bwd + ep_again
                     + load.layers * cp.backward_exposed,
                     fwd + bwd + recompute, tp_seconds, tp_bytes, step_seconds, step_bytes, load,
                     ep_fwd + ep_bwd + ep_again, load.layers * a2a.bytes * (1.5 if full else 1.0),
                     load.layers * cp.seconds, load.layers * cp.exposed, load.layers * cp.bytes, tp_path)


def _estimate(work: Workload, cluster: Cluster, layout: Layout, rate_scale: float) -> Estimate:
    """Each pipeline rank's memory and time for one micro-batch (the largest of each counts), then
    the step: m micro-batches, the bubble, the data-parallel communication not hidden, the optimizer."""
    cfg, lay, s = work.model, layout, work.seq_len
    terms = _terms(work, cluster, lay, rate_scale)
    loads = stage_loads(cfg, lay.pp, lay.virtual_stages, s)
    distinct, stage_of_rank = distinct_stages(cfg, lay.pp, lay.virtual_stages, s)
    memory = peak_rank_memory(work, lay, terms, loads, distinct, stage_of_rank)
    times = [_rank_time(cluster, lay, terms, load) for load in distinct]  # equal stages, equal times
    ranks = [times[index] for index in stage_of_rank]
    slowest_rank = max(range(len(ranks)), key=lambda rank: ranks[rank].total)
    slowest = ranks[slowest_rank]
    m, t, p, v = terms.micro_batches, lay.tp, lay.pp, lay.virtual_stages
    # the step's sums of partial gradients: under ZeRO-1/2 each rank sums its data-parallel shard
    shards = lay.shards if lay.zero in (1, 2) else 1
    sums_bytes, sums_seconds = slowest.tp_step_bytes / shards, slowest.tp_step_seconds / shards
    comm_bytes = {"tp": slowest.tp_bytes * m + sums_bytes, "pp": 2 * v * m * terms.pp_message * (p > 1)}
    comm_seconds = {"tp": slowest.tp_seconds * m + sums_seconds, "pp": 2 * v * m * terms.pp_send_s * (p > 1)}
    held = params_held(cfg, lay, slowest.load.params, slowest.load.layers, slowest.load.first, slowest.load.last)
    dense, experts = expert_share(cfg, lay, held, slowest.load.moe_layers)
    load, split = slowest.load, (False if experts else None)  # the experts' buckets apart from the others'
    comm_seconds["dp"], dp_exposed, comm_bytes["dp"] = data_parallel_seconds(
        cluster, lay, collective_parts(cfg, lay, load.layers, load.first, load.last, split, dense, bucket_mb_for(work, lay)),
        m, slowest.forward, slowest.backward, pipeline_overlap=work.pipeline_dp_overlap)
    tp_path = slowest.tp_seconds if slowest.tp_exposed is None else slowest.tp_exposed
    exposed = {"tp": tp_path * m + sums_seconds, "dp": dp_exposed, "pp": comm_seconds["pp"]}
    if lay.cp > 1:  # the K/V ring or Ulysses' all-to-alls; what the attention hides counts in the total only
        comm_seconds["cp"], exposed["cp"] = slowest.cp_seconds * m, slowest.cp_exposed * m
        comm_bytes["cp"] = slowest.cp_bytes * m
    if cfg.moe:  # the all-to-alls, exposed; the experts' gradients over their own group, after the dense ones
        comm_seconds["ep"] = exposed["ep"] = slowest.ep_seconds * m
        comm_bytes["ep"] = slowest.ep_bytes * m
        comm_seconds["edp"], exposed["edp"], comm_bytes["edp"] = data_parallel_seconds(
            cluster, lay, collective_parts(cfg, lay, load.layers, load.first, load.last, True, experts, bucket_mb_for(work, lay)),
            m, slowest.forward, max(0.0, slowest.backward - comm_seconds["dp"]), expert_group(lay),
            work.pipeline_dp_overlap)
    updated = updated_params(cfg, lay, held, slowest.load.moe_layers)  # by this rank's optimizer step
    held = dense + experts  # what the rank holds, its experts included
    # the fill and the drain wait on the other stages' work: with equal stages a slot is any stage's
    # micro-batch; with unequal ones, the others' (the slowest stage's own is all in m x its time)
    others = [r.total for rank, r in enumerate(ranks) if rank != slowest_rank] or [slowest.total]
    bubble_time = bubble_seconds(lay, m, sum(others) / len(others))
    optimizer = optimizer_seconds(cluster, lay, updated)
    gradient_passes = gradient_pass_seconds(cluster, lay, held, m, work.fused_accumulation) / rate_scale
    # the partial gradients' sums run after the last backward, before the update
    step = m * slowest.total + sums_seconds + gradient_passes + bubble_time + dp_exposed + optimizer + exposed.get("edp", 0.0)
    io = exposed_io = 0.0
    tiers = {}
    if offloads(lay):
        page_cache = cluster.device.memory_bytes - sum(memory.values()) if cluster.device.name == "cpu-local" else 0
        off = offload_cost(cluster.device, lay, held, max(cfg.unit_params()) / t,
                           terms.activation_per_layer * slowest.load.layers, m,
                           cfg.unit_params()[0] / t if cfg.tie_embeddings else 0.0, max(page_cache, 0.0))
        exposed_io = off.first_read_s + max(0.0, off.during_compute_s - m * slowest.total)
        io, tiers = off.total_s, off.tier_bytes
        if cluster.device.host_memory_bytes is None:  # the host is the device (cpu-local): nothing saved there
            memory["buffers"] += tiers.pop("host", 0.0)
        # the step's pass over the tiers: as long as the longer of its arithmetic and its transfers
        exposed_io += max(0.0, off.optimizer_s - optimizer)
        step += exposed_io
    tokens_per_step = work.global_batch * s
    counts = _model_counts(cfg, s)
    params, attention = counts.matmul_params, 2 * counts.attention_products
    blocks = counts.blocks_matmul_params  # what full checkpointing runs again: the blocks, not the head
    recomputed = {"none": 0, "selective": attention, "full": 2 * blocks + attention}[lay.checkpointing]
    hardware_flops = tokens_per_step * (6 * params + 3 * attention + recomputed)
    world = lay.world_size
    overflow = _tier_overflow(cluster.device, tiers)
    # the ranks' own compute, not the slowest's: a stage with less work leaves its core to the others
    mean_compute = sum(r.compute for r in ranks) / len(ranks)
    busy = m * mean_compute + gradient_passes + optimizer + sum(comm_seconds.values())
    overhead = device_overhead(cluster.device, lay, sum(memory.values()))
    e = Estimate(lay, sum(memory.values()) + sum(overhead.values()) <= cluster.device.memory_bytes and not overflow,
                 memory, comm_seconds,
                 comm_bytes, compute_s=m * slowest.compute + gradient_passes, bubble=bubble_time / step,
                 step_time_s=step, tokens_per_s=tokens_per_step / step,
                 tflops_per_device=hardware_flops / step / world / 1e12,
                 mfu=tokens_per_step * counts.flops_per_token / step / world / terms.peak,
                 kernel_ceiling=terms.kernel_ceiling,
                 exposed_comm_s=exposed, optimizer_s=optimizer, tier_bytes=tiers, io_s=io, exposed_io_s=exposed_io,
                 total_params=counts.num_params, active_params=counts.active_params,
                 all_to_all_s=comm_seconds.get("ep", 0.0), all_to_all_bytes=comm_bytes.get("ep", 0.0),
                 ep_crosses_nodes=terms.all_to_all.crosses_nodes,
                 all_to_all_across_s=comm_seconds.get("ep", 0.0) * terms.across, seq_len=s, busy_s=busy,
                 device_overhead=overhead)
    e.notes += overflow + overhead_note(e.memory_bytes_per_device, overhead, cluster.device)
    return e




@dataclass(frozen=True)
class _ModelCounts:
    """What _estimate reads of the model for every layout: the same model methods' answers,
    counted once per model and sequence length rather than once per layout searched."""
    num_params: int
    active_params: int
    flops_per_token: int
    matmul_params: int
    attention_products: int
    blocks_matmul_params: int


@lru_cache(maxsize=256)
def _model_counts(cfg: ModelConfig, seq_len: int) -> _ModelCounts:
    return _ModelCounts(cfg.num_params(), cfg.active_params(), cfg.flops_per_token(seq_len), cfg.matmul_params(),
                        cfg.attention_products(seq_len), cfg.blocks_matmul_params())


def _tier_overflow(device: Device, tiers: dict[str, float]) -> list[str]:
    """Why the offload tiers cannot hold what a layout puts there, if they cannot."""
    room = {"host": device.host_memory_bytes or 0.0, "disk": device.disk_bytes}
    return [f"does not fit: its {tier} tier would hold {held / 1e9:.1f} GB per device, and has {room[tier] / 1e9:.1f} GB"
            for tier, held in tiers.items() if held > room[tier]]
