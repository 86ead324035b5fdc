"""What a step does with the gradients and states of the ranks holding the same parameters (dp,
and with context parallelism dp x cp): the data-parallel and ZeRO collectives and what of them
compute hides, the passes over the gradients outside the GEMMs, and the optimizer step. Terms and
sources: docs/cost-model.md; the estimate that adds them up: plan/cost.py."""

from __future__ import annotations

from strata.plan.buckets import Parts
from strata.plan.links import Cluster, collective_seconds
from strata.rules.compression import onebit_wire_bytes
from strata.rules.dtypes import DTYPES
from strata.rules.layout import Layout

BYTES = {name: DTYPES[name].bytes for name in ("bf16", "fp16", "fp32")}  # the training precisions priced


def data_parallel_seconds(cluster: Cluster, lay: Layout, parts: Parts, m: int, t_fwd: float, t_bwd: float,
                          group: tuple[int, int] | None = None, pipeline_overlap: bool = False):
    """(total seconds, exposed seconds, bytes per device): ZeRO's collectives over the ranks that
    shard the states (`zero_seconds`) and, with hybrid sharding (--dp-shard), the all-reduce of
    this rank's gradient shard across the replicas holding the same shard: once a step, after the
    last backward (parallel/data.py), exposed. Under a pipeline `parts` are one stage's, over its
    own shard and replica groups (mesh.py makes both at every pipeline place). pipeline_overlap:
    under a pipeline, the buckets reduce behind the last micro-batch's backward as they do without
    one (Workload.pipeline_dp_overlap, Megatron-Core's --overlap-grad-reduce); strata's runtime
    reduces them after the schedule."""
    total, exposed, nbytes = zero_seconds(cluster, lay, parts, m, t_fwd, t_bwd, group, pipeline_overlap)
    if group is not None or lay.shards == lay.replicas:
        return total, exposed, nbytes
    replicas, shard = lay.replicas // lay.shards, sum(size * n for size, n in parts.sizes) / lay.shards
    seconds = collective_seconds(cluster, "all_reduce", shard * BYTES[lay.reduce_dtype], replicas, lay.tp * lay.shards,
                                 together=True)
    return total + seconds, exposed + seconds, nbytes + 2 * (replicas - 1) / replicas * shard * BYTES[lay.reduce_dtype]


def zero_seconds(cluster: Cluster, lay: Layout, parts: Parts, m: int, t_fwd: float, t_bwd: float,
                 group: tuple[int, int] | None = None, pipeline_overlap: bool = False):
    """(total seconds, seconds not hidden behind compute, bytes per device) of the ranks holding the
    same parameters, dp x cp of them tp apart (or `group`: (size, stride), a mixture's
    expert-data-parallel one). `parts`: the parameters each collective carries, as the runtime
    issues them (plan/buckets.py): ZeRO-0/1/2 one per gradient bucket, ZeRO-3 one per unit, each
    paying its latency. Each collective is priced in the dtype the runtime moves: gradients in the
    reduce dtype, parameters (ZeRO-3's gathers, ZeRO-1/2's of the updated shards) in the gather
    dtype, each bucket at its padded size (what the runtime moves). Every rank runs these at the
    same point of its step, so they are priced `together`: no process computes through another's
    wait. ZeRO++'s hpZ (--hpz-partition-size K) gathers for backward over K adjacent dp ranks alone
    (inside a node where K x tp fit in one: its fast links), Ψ(K-1)/K instead of Ψ(N-1)/N."""
    d, stride = group or (lay.shards, lay.tp)
    if d == 1:
        return 0.0, 0.0, 0.0
    if not cluster.overlap:  # nothing runs beside compute: every second is exposed
        t_fwd = t_bwd = 0.0
    ring = (d - 1) / d
    after_schedule = lay.pp > 1 and not pipeline_overlap  # every bucket reduced after the schedule: exposed
    params_local = sum(size * n for size, n in parts.sizes)
    grad_bytes = params_local * BYTES[lay.reduce_dtype]
    gather_bytes = params_local * BYTES[lay.gather_dtype]

    def one_by_one(op: str, dtype: str, ranks: int = d) -> tuple[float, float]:
        """(all of them, the last one's) seconds of `op` over the parts in `dtype`, on `ranks` of the group."""
        def seconds(size: float) -> float:
            return collective_seconds(cluster, op, size * BYTES[dtype], ranks, stride, together=True)
        return sum(n * seconds(size) for size, n in parts.sizes), seconds(parts.last)

    if lay.zero == 3:  # all-gather forward, all-gather backward, reduce-scatter: every micro-batch,
        # one collective per unit (plan/buckets.unit_parts)
        (gathers, gather), (per_mb_scatter, scatter) = one_by_one("all_gather", lay.gather_dtype), \
            one_by_one("reduce_scatter", lay.reduce_dtype)
        if lay.pp > 1 and not lay.reshard_after_forward:
            # a stage's units gathered once, as the first micro-batch's forward reaches them (all but
            # the first behind its compute), kept; one reduce-scatter each after the schedule, exposed
            exposed = gather + max(0.0, gathers - gather - t_fwd) + per_mb_scatter
            return gathers + per_mb_scatter, exposed, ring * (gather_bytes + grad_bytes)
        k = lay.hpz_partition_size if group is None else 1  # hpZ: the backward's gathers over its node group
        backward_gathers = one_by_one("all_gather", lay.gather_dtype, k)[0] if k > 1 else gathers
        per_mb = gathers + backward_gathers + per_mb_scatter
        # prefetch hides the rest behind compute, but the first unit's gather comes before any
        # compute and the last unit's reduce-scatter after it
        ends = gather + scatter
        exposed = (ends + max(0.0, per_mb - ends - (t_fwd + t_bwd))) * m
        backward_bytes = ((k - 1) / k if k > 1 else ring) * gather_bytes
        return per_mb * m, exposed, (ring * (gather_bytes + grad_bytes) + backward_bytes) * m
    if lay.compress in ("onebit", "zeroone"):
        rounds, exposed, sent = _onebit_seconds(cluster, parts, d, stride)
        if lay.zero == 0:
            return rounds, exposed, sent
        # ZeRO-1: the updated shards all-gathered after the step, uncompressed, behind the next
        # forward as below (parallel/onebit_adam.py `OnebitShardStates`)
        ag, first = one_by_one("all_gather", lay.gather_dtype)
        return rounds + ag, exposed + first + max(0.0, ag - first - t_fwd), sent + ring * gather_bytes
    if parts.compressed is not None:
        return _powersgd_seconds(cluster, lay, parts, d, stride, t_bwd, grad_bytes)
    if lay.zero == 0:  # one all-reduce per bucket
        total, last = one_by_one("all_reduce", lay.reduce_dtype)
        # buckets reduce while the last micro-batch's backward runs, all but the last one, which is
        # ready only when the backward ends; after a pipeline schedule, all of them at the end
        exposed = total if after_schedule else max(last, total - t_bwd)
        return total, exposed, 2 * ring * grad_bytes
    # ZeRO-1: one reduce-scatter per bucket a step (overlapping the last backward unless a pipeline
    # schedule ran), ZeRO-2: every micro-batch, the last bucket of each exposed (under a pipeline,
    # once after the schedule, as ZeRO-1: parallel/gradients.py); then an all-gather
    # of each bucket's updated shards, the buffer's last bucket (the first layers') first, each
    # waited for by the next forward as it reaches the bucket: all but the first hide behind the
    # first micro-batch's forward (parallel/gradients.py `after_step`)
    reductions = m if lay.zero == 2 and lay.pp == 1 else 1
    (rs, last), (ag, first) = one_by_one("reduce_scatter", lay.reduce_dtype), one_by_one("all_gather", lay.gather_dtype)
    hidden = 0.0 if after_schedule else t_bwd
    exposed = max(last if hidden else rs, rs - hidden) * reductions + first + max(0.0, ag - first - t_fwd)
    return rs * reductions + ag, exposed, ring * (grad_bytes * reductions + gather_bytes)


# PowerSGD's work on a compressed matrix M, in passes over its fp32 elements: M Q, M^T P and P Q^T
# each read M (thin products at small rank: memory-bound), the error is added (read, write) and
# kept (a write)
POWERSGD_PASSES = 6


def _powersgd_seconds(cluster: Cluster, lay: Layout, parts: Parts, d: int, stride: int, t_bwd: float,
                      grad_bytes: float) -> tuple[float, float, float]:
    """--compress powersgd (ZeRO-0, parallel/powersgd.py): per bucket an all-reduce of the P factors
    (with the tensors left whole) as backward completes it, hidden behind backward as ZeRO-0's are;
    then one all-reduce of every Q factor after backward: exposed, as is the compression's work.
    Under a pipeline a stage compresses its buckets after the schedule (as ZeRO-0 reduces them
    there): both rounds exposed. `parts` are the stage's buckets; the P and Q shares the whole
    model's (plan/memory.powersgd_fractions) applied to them."""
    p_share, q_share, factored = parts.compressed

    def seconds(elements: float) -> float:
        return collective_seconds(cluster, "all_reduce", elements * BYTES["fp32"], d, stride, together=True)
    params = sum(size * n for size, n in parts.sizes)
    p_total, p_last = sum(n * seconds(size * p_share) for size, n in parts.sizes), seconds(parts.last * p_share)
    q_total = seconds(params * q_share)
    work = POWERSGD_PASSES * factored * params * BYTES["fp32"] / cluster.device.memory_bandwidth
    exposed = (p_total if lay.pp > 1 else max(p_last, p_total - t_bwd)) + q_total + work
    return p_total + q_total + work, exposed, 2 * (d - 1) / d * grad_bytes * (p_share + q_share)


# 1-bit Adam's work per step, in passes over the fp32 model (parallel/onebit_adam.py): the worker's
# c = m + e_w (two reads, a write), its scales and signs (two reads), its error (a read, a write);
# the server's decoding of the dp chunks it receives and their sum (a write, a read); the decoded
# average written into m (a write). The server's own chunk (1/dp) is left out.
ONEBIT_PASSES = 10


def _onebit_seconds(cluster: Cluster, parts: Parts, d: int, stride: int) -> tuple[float, float, float]:
    """--compress onebit (ZeRO-0 or ZeRO-1, parallel/onebit_adam.py), after its warm-up: no gradient
    reduction; in the optimizer step, after backward, an all-to-all and an all-gather, each of
    rules/compression.onebit_wire_bytes (the momentum's signs, 8 a byte, and a fp32 scale per
    piece of a tensor in a chunk): exposed, as is the compression's work. The all-to-all is priced
    as an all-gather of the same buffer: each rank sends and receives (N-1)/N of it, over N-1 steps
    (pairwise exchange).
    Beside a pipeline, a stage's own rounds over its dp group: `parts` are its parameters and their
    scales per row (plan/buckets.onebit_scales of the stage).
    The warm-up's steps cost what ZeRO-0's do; the planner prices the steps after it. --compress
    zeroone (0/1 Adam) sends the gradient through the same two collectives on the steps that leave v
    alone, and all-reduces it whole, as ZeRO-0 does, on those that update it (about
    kappa log2(T / kappa) of a run's T: rules/compression.variance_updates); the planner prices the
    former, the steady state of a long run."""
    params = sum(size * n for size, n in parts.sizes)
    wire = onebit_wire_bytes(round(params), d, BYTES["fp32"], parts.scales)
    rounds = 2 * collective_seconds(cluster, "all_gather", wire, d, stride, together=True)
    work = ONEBIT_PASSES * params * BYTES["fp32"] / cluster.device.memory_bandwidth
    return rounds + work, rounds + work, 2 * (d - 1) / d * wire


def gradient_pass_seconds(cluster: Cluster, lay: Layout, params_local: float, m: int, fused: bool) -> float:
    """What a step does to its gradients outside the GEMMs, in passes over fp32 memory at the
    memory's bandwidth (as the optimizer step): ZeRO-0/1 add each micro-batch's gradients after the
    first to the accumulated ones (both read, the sum written: 3 passes; none when the GEMM sums
    them itself, as Megatron-LM's gradient-accumulation fusion does); ZeRO-2/3 stage every
    micro-batch's full gradients for its reduce-scatter (a zeroed buffer, the copy into it) and
    add the reduced shard to the accumulated one."""
    full = 3 * params_local * 4
    # under a pipeline ZeRO-2, and ZeRO-3 with its units kept gathered, accumulate as ZeRO-1 does
    if lay.zero >= 2 and not (lay.pp > 1 and (lay.zero == 2 or not lay.reshard_after_forward)):
        passes = m * full + max(0, m - 1) * full / lay.shards
    else:
        passes = 0.0 if fused else max(0, m - 1) * full
    return passes / cluster.device.memory_bandwidth


def optimizer_seconds(cluster: Cluster, lay: Layout, updated: float) -> float:
    """Adam is memory-bound: it reads and writes its states and the weights once (about 16 bytes
    read + 16 written per parameter it updates: all a rank holds, or under ZeRO its shards,
    plan/experts.updated_params). Offloaded, the gradients go to the host and the weights come back
    over PCIe, and the host does the update."""
    if lay.offload == "cpu":
        return updated * 4 / PCIE_BYTES_PER_S + updated * 32 / HOST_MEMORY_BYTES_PER_S
    return updated * 32 / cluster.device.memory_bandwidth


PCIE_BYTES_PER_S = 25e9  # PCIe 4.0 x16, achieved
HOST_MEMORY_BYTES_PER_S = 50e9  # one socket's DRAM bandwidth, achieved
