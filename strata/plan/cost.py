"""The cost model: memory, communication, compute and pipeline bubble of one layout, per device and
per optimizer step. Every term and its source is in docs/cost-model.md.

A layout's process groups follow strata's mesh order (tp innermost, then dp, then pp): rank
(pp·dp_size + dp)·tp_size + tp. So a tensor-parallel group is a run of adjacent devices, inside a
node when tp divides the devices per node; a data-parallel group spans tp·dp devices; pipeline
stages are the farthest apart. Each group's collectives run on the slowest link they cross."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from strata.model.config import ModelConfig
from strata.plan.hardware import Device
from strata.plan.memory import activation_bytes_per_layer, model_state_bytes

BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Cluster:
    device: Device
    nodes: int = 1
    devices_per_node: int = 8
    intra_bandwidth: float = 0.0  # bytes/s per direction per device inside a node
    inter_bandwidth: float = 0.0  # bytes/s per direction per node between nodes
    intra_latency: float = 5e-6  # seconds per ring step (alpha)
    inter_latency: float = 10e-6
    efficiency: float = 0.58  # fraction of peak FLOP/s a step's compute reaches (calibrated for cpu-local)
    # cpu-local only: measured bandwidth/latency per collective and group size (strata calibrate)
    collectives: dict = field(default_factory=dict, compare=False, hash=False)
    runtime_bytes: float = 0.0  # what a process holds before the model (calibrated; 0 on GPUs)

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node


@dataclass(frozen=True)
class Workload:
    model: ModelConfig
    global_batch: int  # sequences per optimizer step
    seq_len: int
    precision: str = "bf16"  # bf16 | fp16: mixed precision (16 bytes/parameter); fp32


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    virtual_stages: int = 1
    zero: int = 0
    micro_batch: int = 1
    checkpointing: str = "none"  # none | selective | full
    offload: str = "none"  # none | cpu (optimizer states and step on the host)
    sequence_parallel: bool = False
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zb

    def describe(self) -> str:
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}"]
        if self.virtual_stages > 1:
            parts.append(f"v={self.virtual_stages}")
        parts += [f"zero={self.zero}", f"mb={self.micro_batch}"]
        if self.pp > 1:
            parts.append(self.schedule)
        if self.sequence_parallel:
            parts.append("sp")
        if self.checkpointing != "none":
            parts.append(f"ckpt={self.checkpointing}")
        if self.offload != "none":
            parts.append(f"offload={self.offload}")
        return ",".join(parts)


@dataclass
class Estimate:
    layout: Layout
    fits: bool
    memory_breakdown: dict[str, float]  # bytes per device: weights, gradients, optimizer states, activations, buffers
    comm_seconds: dict[str, float]  # per step, by group: tp, dp, pp (exposed and total)
    comm_bytes: dict[str, float]  # per device per step, by group
    compute_s: float
    bubble: float  # idle fraction of the step from the pipeline schedule
    step_time_s: float
    tokens_per_s: float
    tflops_per_device: float  # hardware FLOPs (recomputation included), as Megatron-LM reports
    mfu: float  # model FLOPs (6N + attention) over peak
    notes: list[str] = field(default_factory=list)

    @property
    def memory_bytes_per_device(self) -> float:
        return sum(self.memory_breakdown.values())

    def to_json(self) -> dict:
        return {**asdict(self.layout), "fits": self.fits, "memory_bytes_per_device": self.memory_bytes_per_device,
                "memory_breakdown": self.memory_breakdown, "comm_seconds": self.comm_seconds,
                "comm_bytes": self.comm_bytes, "compute_s": self.compute_s, "bubble": self.bubble,
                "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "tflops_per_device": self.tflops_per_device, "mfu": self.mfu, "notes": self.notes}


# --- links -----------------------------------------------------------------------------------------
def group_link(cluster: Cluster, size: int, stride: int) -> tuple[float, float, bool]:
    """(bandwidth per direction each member gets, latency per step, crosses nodes) for a group of
    `size` devices `stride` ranks apart, when every group of its kind communicates at once."""
    if size <= 1:
        return float("inf"), 0.0, False
    per_node = cluster.devices_per_node
    if size * stride <= per_node:
        return cluster.intra_bandwidth, cluster.intra_latency, False
    members_per_node = max(1, per_node // stride) if stride < per_node else 1
    groups_per_node = per_node // members_per_node  # rings that leave each node at once
    across = cluster.inter_bandwidth / groups_per_node
    inside = cluster.intra_bandwidth if members_per_node > 1 else float("inf")
    return min(across, inside), cluster.inter_latency, True


def collective_seconds(cluster: Cluster, op: str, nbytes: float, size: int, stride: int) -> float:
    """Ring alpha-beta time of one collective of `nbytes` (the full tensor) over `size` ranks.
    With a calibrated profile (cpu-local), its measured numbers for this op and group size."""
    if size <= 1 or nbytes == 0:
        return 0.0
    measured = cluster.collectives.get(op, {}).get(str(size))
    if measured is not None:
        return measured["latency_s"] + nbytes / measured["bandwidth"]
    bandwidth, latency, _ = group_link(cluster, size, stride)
    if op == "all_reduce":
        return 2 * (size - 1) * latency + 2 * (size - 1) / size * nbytes / bandwidth
    if op in ("all_gather", "reduce_scatter"):
        return (size - 1) * latency + (size - 1) / size * nbytes / bandwidth
    if op == "send":
        return latency + nbytes / bandwidth
    raise ValueError(f"unknown collective {op!r}")


# --- the estimate ------------------------------------------------------------------------------
def estimate(work: Workload, cluster: Cluster, layout: Layout) -> Estimate:
    cfg, lay = work.model, layout
    t, p, d, v, b, s = lay.tp, lay.pp, lay.dp, lay.virtual_stages, lay.micro_batch, work.seq_len
    h, L, V = cfg.d_model, cfg.n_layers, cfg.vocab_size
    act_bytes = BYTES["bf16" if work.precision in ("bf16", "fp16") else "fp32"]
    micro_batches = work.global_batch // (d * b)
    params = cfg.num_params()
    params_local = params / (t * p)  # balanced stages and an even tensor split
    layers_local = L / p

    # memory per device
    states = model_state_bytes(params_local, lay.zero, d, "mixed" if act_bytes == 2 else "fp32")
    optimizer = 0.0 if lay.offload == "cpu" else states.optimizer
    per_layer = activation_bytes_per_layer(s, b, h, cfg.n_heads, t, lay.sequence_parallel,
                                           lay.checkpointing, fused_attention=True) * act_bytes / 2
    in_flight = _micro_batches_in_flight(lay, micro_batches)
    logits = b * s * V / t * (act_bytes + 4)  # the head's output and the fp32 copy the loss takes
    activations = per_layer * layers_local * in_flight + logits + b * s * h * act_bytes
    buffers = _buffers(cfg, lay, params_local, act_bytes, states)
    memory = {"weights": states.weights, "gradients": states.grads, "optimizer_states": optimizer,
              "activations": activations, "buffers": buffers + cluster.runtime_bytes}
    fits = sum(memory.values()) <= cluster.device.memory_bytes

    # compute per micro-batch per device (forward, backward; recomputation in the backward)
    tokens = b * s
    attention = 4 * L * h * s  # per token, forward: scores and values (PaLM's 12Lhs over 3 passes)
    fwd = tokens * (2 * params + attention) / (t * p)
    recompute = {"none": 0.0, "selective": tokens * attention / (t * p), "full": fwd}[lay.checkpointing]
    peak = cluster.device.peak_flops.get(work.precision, max(cluster.device.peak_flops.values()))
    rate = peak * cluster.efficiency
    t_fwd, t_bwd = fwd / rate, (2 * fwd + recompute) / rate

    # tensor parallelism: per layer 2 all-reduces of b·s·h forward and 2 backward (+2 with full
    # recomputation); sequence parallelism trades each for an all-gather + reduce-scatter
    comm_bytes, comm_seconds = {}, {}
    tp_msg = b * s * h * act_bytes
    tp_per_layer_fwd = 2 * (2 if lay.sequence_parallel else 1)
    ops_fwd = layers_local * tp_per_layer_fwd
    ops_bwd = ops_fwd * (1.5 if lay.checkpointing == "full" else 1.0)
    tp_op = "all_gather" if lay.sequence_parallel else "all_reduce"
    one_tp = collective_seconds(cluster, tp_op, tp_msg, t, 1)
    t_fwd += ops_fwd * one_tp
    t_bwd += ops_bwd * one_tp
    ring = (1 if lay.sequence_parallel else 2) * (t - 1) / t if t > 1 else 0.0
    comm_bytes["tp"] = (ops_fwd + ops_bwd) * ring * tp_msg * micro_batches
    comm_seconds["tp"] = (ops_fwd + ops_bwd) * one_tp * micro_batches

    # data parallelism / ZeRO over dp ranks, stride tp
    grad_bytes = params_local * (act_bytes if act_bytes == 2 else 4)
    dp_total, dp_exposed, dp_bytes = _data_parallel(cluster, lay, grad_bytes, micro_batches, t_fwd, t_bwd,
                                                     layers_local)
    comm_bytes["dp"], comm_seconds["dp"] = dp_bytes, dp_total

    # pipeline: b·s·h activations forward and gradients backward per micro-batch per boundary
    pp_msg = b * s * h * act_bytes / (t if lay.sequence_parallel else 1)
    one_p2p = collective_seconds(cluster, "send", pp_msg, p, t * d) if p > 1 else 0.0
    boundaries = 2 * micro_batches * (v if p > 1 else 0)  # forward + backward, per chunk boundary
    comm_bytes["pp"] = boundaries * pp_msg
    comm_seconds["pp"] = boundaries * one_p2p
    t_fwd += one_p2p * (v if p > 1 else 0)
    t_bwd += one_p2p * (v if p > 1 else 0)

    per_micro_batch = t_fwd + t_bwd
    bubble_time = _bubble_time(lay, per_micro_batch)
    busy = micro_batches * per_micro_batch
    optimizer_s = _optimizer_seconds(cluster, lay, params_local, states)
    step = busy + bubble_time + dp_exposed + optimizer_s
    tokens_per_step = work.global_batch * s
    hardware_flops = tokens_per_step * ((6 * params + 3 * attention) +
                                        {"none": 0, "selective": attention, "full": 2 * params + attention}[lay.checkpointing])
    model_flops = tokens_per_step * cfg.flops_per_token(s)
    world = d * t * p
    return Estimate(lay, fits, memory, comm_seconds, comm_bytes, compute_s=micro_batches * (fwd * 3 + recompute) / rate,
                    bubble=bubble_time / step, step_time_s=step, tokens_per_s=tokens_per_step / step,
                    tflops_per_device=hardware_flops / step / world / 1e12,
                    mfu=model_flops / step / world / peak)


def _micro_batches_in_flight(lay: Layout, m: int) -> float:
    """Micro-batches whose activations the first stage holds at its peak (Narayanan et al. 2021)."""
    if lay.pp == 1:
        return 1
    if lay.schedule == "gpipe":
        return m
    in_flight = min(m, lay.pp)
    if lay.virtual_stages > 1:
        in_flight *= 1 + (lay.pp - 1) / (lay.pp * lay.virtual_stages)
    return in_flight


def _bubble_time(lay: Layout, per_micro_batch: float) -> float:
    """Idle time of a stage: (p-1) micro-batch slots, /v interleaved, about a third of it ZB-H1."""
    if lay.pp == 1:
        return 0.0
    slots = (lay.pp - 1) * per_micro_batch
    if lay.schedule == "interleaved":
        return slots / lay.virtual_stages
    if lay.schedule == "zb":
        return slots / 3
    return slots


def _buffers(cfg: ModelConfig, lay: Layout, params_local: float, act_bytes: int, states) -> float:
    """What the layout adds besides states and activations: ZeRO-3's two gathered units (one in
    use, one prefetched) and ZeRO-2/3's staged gradients of one unit."""
    if lay.zero < 3:
        return 0.0
    unit = params_local / max(1, cfg.n_layers / lay.pp) * act_bytes
    return 3 * unit


def _data_parallel(cluster: Cluster, lay: Layout, grad_bytes: float, m: int, t_fwd: float, t_bwd: float,
                   layers_local: float):
    """(total seconds, seconds not hidden behind compute, bytes per device) of the dp group."""
    d, stride = lay.dp, lay.tp
    if d == 1:
        return 0.0, 0.0, 0.0
    ring = (d - 1) / d
    if lay.zero == 3:  # all-gather forward, all-gather backward, reduce-scatter: every micro-batch,
        # one collective per unit (a block; the embedding; the head), each paying its latency
        units = max(1, round(layers_local)) + 2
        unit_bytes = grad_bytes / units
        per_mb = units * (2 * collective_seconds(cluster, "all_gather", unit_bytes, d, stride) +
                          collective_seconds(cluster, "reduce_scatter", unit_bytes, d, stride))
        exposed = max(0.0, per_mb - (t_fwd + t_bwd)) * m  # prefetch hides it behind compute
        return per_mb * m, exposed, 3 * ring * grad_bytes * m
    if lay.zero == 2:  # reduce-scatter every micro-batch, all-gather of the updated shards once
        rs = collective_seconds(cluster, "reduce_scatter", grad_bytes, d, stride)
        ag = collective_seconds(cluster, "all_gather", grad_bytes, d, stride)
        exposed = max(0.0, rs - t_bwd) * m + ag
        return rs * m + ag, exposed, ring * grad_bytes * (m + 1)
    buckets = max(1, round(grad_bytes / BUCKET_BYTES))  # one all-reduce per 25 MB bucket
    total = buckets * collective_seconds(cluster, "all_reduce", grad_bytes / buckets, d, stride)
    # buckets reduce while the last micro-batch's backward runs; after a pipeline schedule, at the end
    exposed = total if lay.pp > 1 else max(0.0, total - t_bwd)
    return total, exposed, 2 * ring * grad_bytes


def _optimizer_seconds(cluster: Cluster, lay: Layout, params_local: float, states) -> float:
    """Adam is memory-bound: it reads and writes its states and the weights once (about 16 bytes
    read + 16 written per parameter it updates). Offloaded, the gradients go to the host and the
    weights come back over PCIe, and the host does the update."""
    updated = params_local / (lay.dp if lay.zero >= 1 else 1)
    if lay.offload == "cpu":
        return updated * 4 / PCIE_BYTES_PER_S + updated * 32 / HOST_MEMORY_BYTES_PER_S
    return updated * 32 / cluster.device.memory_bandwidth


BUCKET_BYTES = 25 * 2**20  # strata's --bucket-mb default
PCIE_BYTES_PER_S = 25e9  # PCIe 4.0 x16, achieved
HOST_MEMORY_BYTES_PER_S = 50e9  # one socket's DRAM bandwidth, achieved
