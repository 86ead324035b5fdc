"""What the planner prices and what it answers: a training `Workload` (the model, the batch, and
the switches a framework profile sets: strata/plan/frameworks.py) and the `Estimate` of one layout
(strata/plan/cost.py computes it). Every term and its source is in docs/cost-model.md."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from strata.model.config import ModelConfig
from strata.plan.frameworks import framework
from strata.rules.constants import BUCKET_MB, LOGITS_CHUNK_BYTES
from strata.rules.layout import Layout


@dataclass(frozen=True)
class Workload:
    model: ModelConfig
    global_batch: int  # sequences per optimizer step
    seq_len: int
    precision: str = "bf16"  # bf16 | fp16: mixed precision (16 bytes/parameter); fp32
    optimizer: str = "adamw"  # a name of strata/rules/optimizers.py: adamw, sgd (with momentum), lion, adafactor
    # attention in one kernel (SDPA, FlashAttention: strata's); False: scores materialised and
    # softmaxed between two batched GEMMs (Megatron-LM's runs of 2021-2022)
    fused_attention: bool = True
    # weight gradients summed into the fp32 accumulator by the GEMM itself (Megatron-LM's
    # gradient-accumulation fusion); False: each micro-batch's added in a pass of its own (PyTorch's
    # autograd, strata)
    fused_accumulation: bool = False
    # --bucket-mb: ZeRO-0/1/2's gradient buckets, one collective each; None: the framework's
    # (bucket_mb_for: Megatron-Core's grow with dp)
    bucket_mb: float | None = BUCKET_MB
    # 1-D tensor-parallel collectives overlapped with the GEMMs they feed (Megatron-Core's
    # --tp-comm-overlap: plan/frameworks.py); strata's runtime does not (False)
    tp_overlap: bool = False
    # under a pipeline, the data-parallel reductions hidden behind the last micro-batch's backward as
    # without one (Megatron-Core's --overlap-grad-reduce); strata's runtime runs them after the
    # schedule (False)
    pipeline_dp_overlap: bool = False
    # the fused attention kernel's rate: "flash" (FlashAttention-2, strata's SDPA) or "cudnn"
    # (Transformer Engine's on Hopper: hardware.Kernels.with_attention)
    attention_kernel: str = "flash"
    # --fp8: the blocks' linear layers' GEMMs at the device's FP8 peak (Transformer Engine's recipe:
    # bf16 between the layers, fp32 masters; planned only, the runtime computes in 16 bits)
    fp8: bool = False
    # the loss's fp32 logits held at once: strata's chunk (strata/model/loss.py); None: all of them,
    # as a loss that keeps them for backward does (Megatron-LM's)
    logits_chunk_bytes: int | None = LOGITS_CHUNK_BYTES
    framework: str = "strata"  # the profile the switches above came from (plan/frameworks.py)


def with_framework(work: Workload, name: str) -> Workload:
    """The workload as framework `name` runs it: its profile's switches, its buckets."""
    profile = framework(name)
    return replace(work, framework=profile.name, fused_attention=profile.fused_attention,
                   fused_accumulation=profile.fused_accumulation, tp_overlap=profile.tp_overlap, bucket_mb=None,
                   pipeline_dp_overlap=profile.pipeline_dp_overlap, attention_kernel=profile.attention_kernel,
                   logits_chunk_bytes=LOGITS_CHUNK_BYTES if profile.chunked_loss else None)


def bucket_mb_for(work: Workload, lay: Layout) -> float:
    """The gradient bucket a layout's data parallelism runs with: --bucket-mb, or the framework's at
    the layout's replicas."""
    return work.bucket_mb if work.bucket_mb is not None else framework(work.framework).bucket_mb(lay.replicas)


@dataclass
class Estimate:
    layout: Layout
    fits: bool
    memory_breakdown: dict[str, float]  # bytes per device: weights, gradients, optimizer states, activations, buffers
    comm_seconds: dict[str, float]  # per step, by group: tp, dp, pp, cp (exposed and hidden together)
    comm_bytes: dict[str, float]  # per device per step, by group
    compute_s: float
    bubble: float  # idle fraction of the step from the pipeline schedule
    step_time_s: float
    tokens_per_s: float
    tflops_per_device: float  # hardware FLOPs (recomputation included), as Megatron-LM reports
    mfu: float  # model FLOPs (6 per multiplied weight + attention) over peak
    kernel_ceiling: float = 1.0  # the highest fraction of the peak any of its kernels reaches
    exposed_comm_s: dict[str, float] = field(default_factory=dict)  # by group: what no compute hides
    optimizer_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    tier_bytes: dict[str, float] = field(default_factory=dict)  # offloaded: what host memory and disk hold
    io_s: float = 0.0  # offload transfers per step, hidden or not
    exposed_io_s: float = 0.0  # of them, what neither compute nor the optimizer step hides
    total_params: int = 0  # the model's parameters, every expert counted
    active_params: int = 0  # those one token uses (a mixture: its k experts)
    all_to_all_s: float = 0.0  # a mixture under expert parallelism: the step's all-to-alls (in comm_seconds["ep"])
    all_to_all_bytes: float = 0.0  # what a rank sends in them per step
    ep_crosses_nodes: bool = False  # the expert-parallel group spans nodes
    all_to_all_across_s: float = 0.0  # a group inside a node: the all-to-alls split over two nodes (explain)
    seq_len: int = 0  # tokens per sequence, which context parallelism splits (explain)
    # seconds a rank keeps a core busy per step, averaged over the pipeline's ranks (computing,
    # updating, communicating; not waiting): cpu-local's processes share cores by it
    busy_s: float = 0.0
    # what the device holds beside the tensors (memory_breakdown, what max_memory_allocated counts):
    # the CUDA context, NCCL's buffers, the caching allocator's reserve (plan/memory.device_overhead)
    device_overhead: dict[str, float] = field(default_factory=dict)

    def shares(self) -> dict[str, float]:
        """The step split into parts that add up to it: compute, each group's exposed
        communication, the pipeline bubble, the optimizer step and offload transfers not hidden."""
        parts = {"compute": self.compute_s, **{f"{g} communication": s for g, s in self.exposed_comm_s.items()},
                 "pipeline bubble": self.bubble * self.step_time_s, "optimizer step": self.optimizer_s,
                 "offload I/O": self.exposed_io_s}
        return {name: seconds / self.step_time_s for name, seconds in parts.items()}

    @property
    def memory_bytes_per_device(self) -> float:
        """The tensors a device holds at its peak (what torch.cuda.max_memory_allocated counts)."""
        return sum(self.memory_breakdown.values())

    @property
    def device_memory_bytes(self) -> float:
        """All the device's memory the layout takes: its tensors and the device_overhead; what fits."""
        return self.memory_bytes_per_device + sum(self.device_overhead.values())

    def to_json(self) -> dict:
        return {**asdict(self.layout), "fits": self.fits, "memory_bytes_per_device": self.memory_bytes_per_device,
                "memory_breakdown": self.memory_breakdown, "comm_seconds": self.comm_seconds,
                "comm_bytes": self.comm_bytes, "compute_s": self.compute_s, "bubble": self.bubble,
                "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "exposed_comm_seconds": self.exposed_comm_s, "optimizer_s": self.optimizer_s,
                "tflops_per_device": self.tflops_per_device, "mfu": self.mfu, "notes": self.notes,
                "tier_bytes": self.tier_bytes, "io_seconds": self.io_s, "exposed_io_seconds": self.exposed_io_s,
                "total_params": self.total_params, "active_params": self.active_params,
                "all_to_all_seconds": self.all_to_all_s, "all_to_all_bytes": self.all_to_all_bytes,
                "ep_crosses_nodes": self.ep_crosses_nodes, "device_memory_bytes": self.device_memory_bytes,
                "device_overhead": self.device_overhead}
