"""The devices and links the planner knows, from their datasheets.

Peak rates are dense matrix FLOP/s (no sparsity); bandwidths are bytes per second in one
direction. `cpu-local` has no datasheet: `strata calibrate` measures it (planner issue)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

GB = 10**9


@dataclass(frozen=True)
class Kernels:
    """How fast a device runs a training step's kernels."""
    gemm_fraction: float  # of the dense peak the largest GEMMs reach (the curve's saturation)
    gemm_overhead_s: float  # added to every GEMM (its launch and last partial wave)
    attention_fraction: float  # fused attention, forward and backward, over the peak (FLOPs as counted: 12·s·h per token)
    bandwidth_fraction: float  # of the memory bandwidth elementwise kernels reach
    kernel_overhead_s: float  # added to every elementwise kernel
    # seconds an exponential adds per element beyond its bytes (the loss's softmax, forward and
    # backward): measured on a CPU, where it is ten times an add's pass; 0 on the GPUs of the table,
    # where it hides under the memory traffic
    exp_s: float = 0.0
    # of the FP8 peak the largest FP8 GEMMs reach (None: the device has no FP8 matrix units)
    fp8_gemm_fraction: float | None = None
    # the compute clock a training run holds over the clock the fractions above were measured at:
    # the sustained clock at the device's power limit (SUSTAINED_CLOCK_GH100), times a power cap's
    # (power_clock_factor). What the GEMMs and fused attention run at; memory-bound kernels keep
    # the memory's rate
    clock_factor: float = 1.0
    # cuDNN's fused attention (Transformer Engine's choice on Hopper and later), forward and backward,
    # over the peak, where measured; None: the device runs the flash kernel's rate (attention_fraction)
    cudnn_attention_fraction: float | None = None

    def with_attention(self, kernel: str) -> Kernels:
        """These kernels with `kernel`'s fused attention: "flash" (FlashAttention-2, SDPA's flash
        backend) or "cudnn" (where the device has no cuDNN measurement, the flash kernel's rate)."""
        if kernel == "cudnn" and self.cudnn_attention_fraction is not None:
            return replace(self, attention_fraction=self.cudnn_attention_fraction)
        return self

    def fp8(self) -> Kernels:
        """These kernels for FP8 GEMMs: the FP8 curve's saturation in place of the 16-bit one."""
        return replace(self, gemm_fraction=self.fp8_gemm_fraction)

    def gemm_seconds(self, m: float, n: float, k: float, peak: float, bandwidth: float, element_bytes: int,
                     batch: float = 1) -> float:
        """One (batched) GEMM of `batch` products of (m x k)(k x n): the longer of its FLOPs at the
        saturated rate and its operands' bytes at the memory rate, plus the fixed cost."""
        flops = 2 * m * n * k * batch
        moved = (m * k + k * n + m * n) * batch * element_bytes
        return max(flops / (peak * self.gemm_fraction * self.clock_factor), moved / bandwidth) + self.gemm_overhead_s

    def gemm_efficiency(self, m: float, n: float, k: float, peak: float, bandwidth: float,
                        element_bytes: int) -> float:
        """The fraction of the peak a GEMM of this shape reaches: the curve the planner reads."""
        return 2 * m * n * k / peak / self.gemm_seconds(m, n, k, peak, bandwidth, element_bytes)


# How fast each device runs a training step's kernels (strata/plan/compute.py; sources in
# docs/cost-model.md). The largest GEMMs' fraction of the peak is measured for the best shape
# (Bekman, ml-engineering, "Maximum Achievable Matmul FLOPS": A100 SXM 85.9%, H100 SXM 80.1%, GH200
# 83.0%; in its later table B200 SXM 77.6%, MI300X 51.4% (ROCm 6.3, TunableOp), and FP8 (e4m3) H100
# SXM 70.9%, H200 SXM 73.4%, B200 SXM 76.3%); fused attention from FlashAttention-2 (Dao 2023: 50-73% of the peak on A100, forward;
# Shah et al. 2024: 35% on H100). Three defaults are set from published runs, the fit half of the
# validation table only (strata/plan/validation_table.py; bench/validation.py --fit, least squares):
# the share of that best rate a training step's GEMMs reach (forward, and the two backward GEMMs, at
# the model's shapes), the fixed cost of a GEMM, and the fraction of the memory bandwidth
# elementwise kernels reach.
TRAINING_GEMM_SHARE = 0.80
GEMM_OVERHEAD_S = 16e-6
BANDWIDTH_FRACTION = 0.8
KERNEL_OVERHEAD_S = 5e-6  # a CUDA kernel launch, as PyTorch's eager mode issues them


# The clock a GH100 (H100 SXM5, H800, H200) holds through a training run at its 700 W limit, over the
# boost clock short benchmarks (the GEMM and attention fractions above) run at: dense GEMMs drive the
# board to its power limit and the SM clock down (Bekman, ml-engineering, compute/accelerator: an
# H200's 841.9 TFLOP/s burst at 1,980 MHz against 708.5 sustained at about 1,465 MHz and 693 W).
# llm-foundry's 45 configurations run on H100 and A100-80GB from one image show it: every H100 row
# about 18% slower than the A100 curve's ratio predicts, recomputation or not (docs/cost-model.md,
# "The sustained clock"). No A100 figure shows it (400 W holds its clock within a few per cent).
SUSTAINED_CLOCK_GH100 = 708.5 / 841.9


def _kernels(best_gemm_fraction: float, attention_fraction: float, best_fp8_fraction: float | None = None,
             clock: float = 1.0, cudnn_attention: float | None = None) -> Kernels:
    return Kernels(best_gemm_fraction * TRAINING_GEMM_SHARE, GEMM_OVERHEAD_S, attention_fraction, BANDWIDTH_FRACTION,
                   KERNEL_OVERHEAD_S,
                   fp8_gemm_fraction=None if best_fp8_fraction is None else best_fp8_fraction * TRAINING_GEMM_SHARE,
                   clock_factor=clock, cudnn_attention_fraction=cudnn_attention)


# cuDNN's fused attention on an H100 SXM5 (Shah et al. 2024, FlashAttention-3, its speed figures at
# head dimension 128, 4k tokens, bf16, no causal mask): 609 TFLOP/s forward and 499 backward against
# FlashAttention-2's 368 and 310; a forward and a backward (2.5 x its FLOPs) at those rates: 53% of
# the peak (FA2: 33%, the table's 0.35).
CUDNN_ATTENTION_GH100 = 3.5 / (1 / 609 + 2.5 / 499) * 1e12 / 989e12


# What a device's memory holds besides the tensors max_memory_allocated counts, per process:
# - the CUDA context (driver, kernels loaded lazily since CUDA 11.7, cuBLAS workspaces): about 300-400
#   MB with PyTorch (pytorch/pytorch issues 107667 and 109888, a PyTorch maintainer), taken as 0.5 GB;
# - NCCL's buffers, per communicator (a process group of more than one rank): 1.06 GB on 8 x H100
#   before any all-to-all (NVIDIA/nccl issue 1685; "more communicators = more memory", issue 864);
#   taken as 1 GB each;
# - the caching allocator's reserve: memory it holds in segments it cannot hand out whole. GMLake
#   (Guo et al., ASPLOS 2024) measured 15% of the reserved memory on average (up to 33%) across
#   eight LLMs on A100-80GB with recomputation, offload and ZeRO; the planner takes 10% of the
#   tensors, between that and an unfragmented pool.
CUDA_CONTEXT_BYTES = 0.5 * GB
NCCL_GROUP_BYTES = 1.0 * GB
ALLOCATOR_RESERVE = 0.10


# The tiers below device memory that offloading uses (ZeRO-Offload, ZeRO-Infinity), bytes/s per
# device: host memory over PCIe, per direction, at about 80% of the link (3.0 x16: 16 GB/s, 4.0: 32,
# 5.0: 64); and the node's NVMe drives shared by its devices, each drive about 6.5 GB/s read and
# 3.5 GB/s written sequentially (PCIe 4.0 U.2 data-centre drives' datasheets), 4 drives for 8 GPUs
# in a DGX A100, 8 in a DGX H100/H200 (NVIDIA's DGX datasheets). cpu-local: `strata calibrate`
# measures this machine's disk (and its host tier is its own memory).
# What the tiers hold, per device (a node's share): a DGX-1 V100 has 512 GB of host memory and
# 7.68 TB of NVMe, a DGX A100 1 TB (2 TB in its 640 GB model) and 15.36 TB, a DGX H100/H200 2 TB
# and 30.72 TB, for 8 GPUs; an RTX 4090 workstation, taken as 64 GB and 2 TB for one card.
PCIE3, PCIE4, PCIE5 = 12.8 * GB, 25.6 * GB, 51.2 * GB
NVME_READ, NVME_WRITE = 6.5 * GB, 3.5 * GB


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int
    peak_flops: dict[str, float]  # by compute dtype: "bf16", "fp16", "fp32"
    memory_bandwidth: float  # bytes/s, HBM (or GDDR)
    nvlink_bandwidth: float | None  # bytes/s per direction per device; None: no NVLink
    kernels: Kernels = field(default_factory=lambda: _kernels(0.8, 0.5))  # cpu-local: strata calibrate's
    host_bandwidth: float = PCIE4  # bytes/s to and from host memory, per direction
    disk_read: float | None = NVME_READ / 2  # bytes/s this device's share of the node's drives reads
    disk_write: float | None = NVME_WRITE / 2  # (None: not measured; disk offload is not priced)
    disk_cached_read: float | None = None  # what a read the page cache serves reaches (cpu-local: measured)
    # the host memory offloaded states may fill, this device's share (None: the host is the device, cpu-local)
    host_memory_bytes: float | None = 128 * GB
    disk_bytes: float = 1920 * GB  # the disk offloaded files may fill, this device's share
    fp8_flops: float | None = None  # dense FP8 peak (None: no FP8 matrix units)
    # (lowest, highest) power limit `nvidia-smi -pl` accepts, W (None: not known; --power-cap refused)
    power_range_w: tuple[float, float] | None = None
    nvlink_domain: int = 8  # devices one NVLink (or Infinity Fabric) fabric joins: H100 NVL's bridges join 2
    # beside the tensors, per process (above): the context, each communicator's buffers, the
    # allocator's reserve as a fraction of the tensors (cpu-local: none of them)
    context_bytes: float = CUDA_CONTEXT_BYTES
    group_bytes: float = NCCL_GROUP_BYTES
    allocator_reserve: float = ALLOCATOR_RESERVE


# NVIDIA datasheets (V100 SXM2, A100 SXM4, A800 SXM4, H100 SXM5, H200 SXM, GeForce RTX 4090).
# fp32 is the plain (non-TF32) rate; RTX 4090's 16-bit rate is with fp32 accumulation. Dense rates
# (no sparsity): a datasheet's "with sparsity" figure halved. Power ranges: nvidia-smi -q's Min and
# Max Power Limit (H100 SXM5 200-700 W, A100 SXM4 100-400 W as printed by the driver); A800 and H800
# on the same boards as A100 and H100, H200 taken as H100's (700 W TDP, its floor not confirmed).
DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("V100-32G", 32 * GB, {"fp16": 125e12, "fp32": 15.7e12}, 900 * GB, 150 * GB, _kernels(0.8, 0.5), PCIE3,
           host_memory_bytes=64 * GB, disk_bytes=960 * GB),
    Device("A100-40G", 40 * GB, {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, 1555 * GB, 300 * GB,
           _kernels(0.859, 0.5), power_range_w=(100, 400)),
    Device("A100-80G", 80 * GB, {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, 2039 * GB, 300 * GB,
           _kernels(0.859, 0.5), power_range_w=(100, 400)),
    Device("A800-80G", 80 * GB, {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, 2039 * GB, 200 * GB,
           _kernels(0.859, 0.5), power_range_w=(100, 400)),
    Device("H100-80G", 80 * GB, {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, 3350 * GB, 450 * GB,
           _kernels(0.801, 0.35, 0.709, SUSTAINED_CLOCK_GH100, CUDNN_ATTENTION_GH100), PCIE5, NVME_READ, NVME_WRITE, host_memory_bytes=256 * GB, disk_bytes=3840 * GB,
           fp8_flops=1979e12, power_range_w=(200, 700)),
    # H800 SXM5: H100 SXM5's compute and memory, NVLink cut to 400 GB/s both directions (NVIDIA's H800
    # specification as public summaries quote it; DeepSeek-V3's report, arXiv 2412.19437, measures
    # 160 GB/s of it)
    Device("H800", 80 * GB, {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, 3350 * GB, 200 * GB,
           _kernels(0.801, 0.35, 0.709, SUSTAINED_CLOCK_GH100, CUDNN_ATTENTION_GH100), PCIE5, NVME_READ, NVME_WRITE, host_memory_bytes=256 * GB, disk_bytes=3840 * GB,
           fp8_flops=1979e12, power_range_w=(200, 700)),
    # H100 NVL (H100 datasheet, NVL column): 94 GB at 3.9 TB/s, 1,671 TFLOP/s bf16 and 3,341 fp8 with
    # sparsity, 60 fp32, 350-400 W; PCIe cards whose NVLink bridges join pairs at 600 GB/s
    Device("H100-NVL", 94 * GB, {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12}, 3900 * GB, 300 * GB,
           _kernels(0.801, 0.35, 0.709), PCIE5, NVME_READ, NVME_WRITE, host_memory_bytes=256 * GB, disk_bytes=3840 * GB,
           fp8_flops=1670e12, nvlink_domain=2),
    # H20 (NVIDIA's H20 specification for the China market, as public summaries quote it): 96 GB HBM3
    # at 4.0 TB/s, 148 TFLOP/s fp16/bf16 dense, 296 fp8, 44 fp32, NVLink 900 GB/s, 400 W
    Device("H20", 96 * GB, {"bf16": 148e12, "fp16": 148e12, "fp32": 44e12}, 4000 * GB, 450 * GB,
           _kernels(0.801, 0.35, 0.709), PCIE5, NVME_READ, NVME_WRITE, host_memory_bytes=256 * GB, disk_bytes=3840 * GB,
           fp8_flops=296e12),
    Device("H200", 141 * GB, {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, 4800 * GB, 450 * GB,
           _kernels(0.83, 0.35, 0.734, SUSTAINED_CLOCK_GH100, CUDNN_ATTENTION_GH100), PCIE5, NVME_READ, NVME_WRITE, host_memory_bytes=256 * GB, disk_bytes=3840 * GB,
           fp8_flops=1979e12, power_range_w=(200, 700)),
    # B200 (DGX B200 datasheet, per GPU of 8: 72 PFLOP/s fp8 and 36 fp16/bf16 with sparsity, 1,440 GB
    # at 64 TB/s, NVLink 5 at 1.8 TB/s; 80 TFLOP/s fp32 at 1,000 W, NVIDIA's HGX B200 figures)
    Device("B200", 180 * GB, {"bf16": 2250e12, "fp16": 2250e12, "fp32": 80e12}, 8000 * GB, 900 * GB,
           _kernels(0.776, 0.35, 0.763), PCIE5, NVME_READ, NVME_WRITE, host_memory_bytes=256 * GB, disk_bytes=3840 * GB,
           fp8_flops=4500e12),
    # MI300X (AMD Instinct MI300X data sheet): 192 GB HBM3 at 5.3 TB/s, 1,307.4 TFLOP/s bf16/fp16 and
    # 2,614.9 fp8 dense, 163.4 fp32; 7 Infinity Fabric links of 128 GB/s (896 GB/s, 448 each way) to
    # the other 7 of an 8-GPU platform; 750 W. No FP8 GEMM measurement: taken at the bf16 fraction.
    Device("MI300X", 192 * GB, {"bf16": 1307.4e12, "fp16": 1307.4e12, "fp32": 163.4e12}, 5300 * GB, 448 * GB,
           _kernels(0.514, 0.35, 0.514), PCIE5, NVME_READ, NVME_WRITE, host_memory_bytes=256 * GB, disk_bytes=3840 * GB,
           fp8_flops=2614.9e12),
    Device("RTX-4090", 24 * GB, {"bf16": 165e12, "fp16": 165e12, "fp32": 82.6e12}, 1008 * GB, None,
           _kernels(0.8, 0.5), PCIE4, NVME_READ, NVME_WRITE, host_memory_bytes=64 * GB, disk_bytes=2000 * GB),
)}

# `torch.cuda.get_device_name()` -> the table's entry, for the parts whose datasheet is the entry's:
# peak FLOP/s and memory. Left out on purpose, as other parts with other peaks: H100 and H800 PCIe
# (756 TFLOP/s bf16), H200 NVL, GH200, V100 PCIe (112 fp16) and V100S, RTX 4090 D, V100 16 GB, and any
# MIG slice (a fraction of the device). A100 and A800 PCIe have the SXM4 peak; their name carries the
# memory. MI300X: ROCm's name for it ("VF": the whole GPU passed to a virtual machine).
CUDA_NAMES: tuple[tuple[str, str], ...] = (
    (r"\bH100 80GB HBM3$|\bH100 SXM", "H100-80G"),  # "NVIDIA H100 80GB HBM3" is the SXM5 part
    (r"\bH100 NVL$", "H100-NVL"),
    (r"\bH800 80GB HBM3$|\bH800 SXM|\bH800$", "H800"),
    (r"\bH20$", "H20"),
    (r"\bH200$", "H200"),
    (r"\bB200$", "B200"),
    (r"\bMI300X( VF)?$", "MI300X"),
    (r"\bA100\b.*\b80GB\b", "A100-80G"),
    (r"\bA100\b.*\b40GB\b", "A100-40G"),
    (r"\bA800\b.*\b80GB\b", "A800-80G"),
    (r"\bV100-SXM2-32GB$", "V100-32G"),
    (r"\bRTX 4090$", "RTX-4090"),
)


def power_clock_factor(device: Device, cap_w: float) -> float:
    """The compute clock under a power cap of `cap_w` watts over the uncapped clock. The rule: a
    capped GPU lowers its SM clock until it draws the cap (nvidia-smi -pl); dynamic power goes as
    f·V² and, across the range DVFS moves it, the voltage with the frequency, so power goes as f³
    and the clock as the cube root of the cap over the highest limit. The whole board's power is
    taken as scaling so (static and memory power do not, so deep caps lose more than this says);
    the memory's clock is not capped, so memory-bound kernels keep their rate (Ma et al. 2026,
    arXiv 2605.11999: H200 decode draws 137-300 W and no cap binds it)."""
    return (cap_w / device.power_range_w[1]) ** (1 / 3)


def device_for_cuda_name(name: str) -> str | None:
    """The table entry of a CUDA device, from `torch.cuda.get_device_name()`; None for a device
    the table does not describe (another part, a MIG slice)."""
    name = " ".join(name.split())
    if re.search(r"\bMIG\b", name):
        return None
    return next((entry for pattern, entry in CUDA_NAMES if re.search(pattern, name, re.IGNORECASE)), None)


# Links between devices, bytes/s per direction: PCIe 4.0 x16 inside a node; Ethernet and
# InfiniBand (HDR 200 Gb/s, NDR 400 Gb/s) per node between nodes.
LINKS: dict[str, float] = {
    "pcie": 32 * GB,
    "10gbe": 1.25 * GB,
    "100gbe": 12.5 * GB,
    "ib-200": 25 * GB,
    "ib-400": 50 * GB,
}


def get_device(name: str) -> Device:
    if name not in DEVICES:
        raise KeyError(f"unknown device {name!r}; valid: {', '.join(DEVICES)}")
    return DEVICES[name]
