"""The devices and links the planner knows, from their datasheets.

Peak rates are dense matrix FLOP/s (no sparsity); bandwidths are bytes per second in one
direction. `cpu-local` has no datasheet: `strata calibrate` measures it (planner issue)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

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

    def gemm_seconds(self, m: float, n: float, k: float, peak: float, bandwidth: float, element_bytes: int,
                     batch: float = 1) -> float:
        """One (batched) GEMM of `batch` products of (m x k)(k x n): the longer of its FLOPs at the
        saturated rate and its operands' bytes at the memory rate, plus the fixed cost."""
        flops = 2 * m * n * k * batch
        moved = (m * k + k * n + m * n) * batch * element_bytes
        return max(flops / (peak * self.gemm_fraction), moved / bandwidth) + self.gemm_overhead_s

    def gemm_efficiency(self, m: float, n: float, k: float, peak: float, bandwidth: float,
                        element_bytes: int) -> float:
        """The fraction of the peak a GEMM of this shape reaches: the curve the planner reads."""
        return 2 * m * n * k / peak / self.gemm_seconds(m, n, k, peak, bandwidth, element_bytes)


# How fast each device runs a training step's kernels (strata/plan/compute.py; sources in
# docs/cost-model.md). The largest GEMMs' fraction of the peak is measured for the best shape
# (Bekman, ml-engineering, "Maximum Achievable Matmul FLOPS": A100 SXM 85.9%, H100 SXM 80.1%, GH200
# 83.0%); fused attention from FlashAttention-2 (Dao 2023: 50-73% of the peak on A100, forward;
# Shah et al. 2024: 35% on H100). Three defaults are set from published runs, the first half of the
# validation table only (bench/validation.py --fit): the share of that best rate a training step's
# GEMMs reach (forward, and the two backward GEMMs, at the model's shapes), the fixed cost of a GEMM,
# and the fraction of the memory bandwidth elementwise kernels reach.
TRAINING_GEMM_SHARE = 0.85
GEMM_OVERHEAD_S = 8e-6
BANDWIDTH_FRACTION = 0.6
KERNEL_OVERHEAD_S = 5e-6  # a CUDA kernel launch, as PyTorch's eager mode issues them


def _kernels(best_gemm_fraction: float, attention_fraction: float) -> Kernels:
    return Kernels(best_gemm_fraction * TRAINING_GEMM_SHARE, GEMM_OVERHEAD_S, attention_fraction, BANDWIDTH_FRACTION,
                   KERNEL_OVERHEAD_S)


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


# NVIDIA datasheets (V100 SXM2, A100 SXM4, A800 SXM4, H100 SXM5, H200 SXM, GeForce RTX 4090).
# fp32 is the plain (non-TF32) rate; RTX 4090's 16-bit rate is with fp32 accumulation.
DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("V100-32G", 32 * GB, {"fp16": 125e12, "fp32": 15.7e12}, 900 * GB, 150 * GB, _kernels(0.8, 0.5), PCIE3,
           host_memory_bytes=64 * GB, disk_bytes=960 * GB),
    Device("A100-40G", 40 * GB, {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, 1555 * GB, 300 * GB,
           _kernels(0.859, 0.5)),
    Device("A100-80G", 80 * GB, {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, 2039 * GB, 300 * GB,
           _kernels(0.859, 0.5)),
    Device("A800-80G", 80 * GB, {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, 2039 * GB, 200 * GB,
           _kernels(0.859, 0.5)),
    Device("H100-80G", 80 * GB, {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, 3350 * GB, 450 * GB,
           _kernels(0.801, 0.35), PCIE5, NVME_READ, NVME_WRITE, host_memory_bytes=256 * GB, disk_bytes=3840 * GB),
    Device("H200", 141 * GB, {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, 4800 * GB, 450 * GB,
           _kernels(0.83, 0.35), PCIE5, NVME_READ, NVME_WRITE, host_memory_bytes=256 * GB, disk_bytes=3840 * GB),
    Device("RTX-4090", 24 * GB, {"bf16": 165e12, "fp16": 165e12, "fp32": 82.6e12}, 1008 * GB, None,
           _kernels(0.8, 0.5), PCIE4, NVME_READ, NVME_WRITE, host_memory_bytes=64 * GB, disk_bytes=2000 * GB),
)}

# `torch.cuda.get_device_name()` -> the table's entry, for the parts whose datasheet is the entry's:
# peak FLOP/s and memory. Left out on purpose, as other parts with other peaks: H100 PCIe (756 TFLOP/s
# bf16) and NVL (835), H200 NVL, GH200, V100 PCIe (112 fp16) and V100S, RTX 4090 D, V100 16 GB, and any MIG
# slice (a fraction of the device). A100 and A800 PCIe have the SXM4 peak; their name carries the memory.
CUDA_NAMES: tuple[tuple[str, str], ...] = (
    (r"\bH100 80GB HBM3$|\bH100 SXM", "H100-80G"),  # "NVIDIA H100 80GB HBM3" is the SXM5 part
    (r"\bH200$", "H200"),
    (r"\bA100\b.*\b80GB\b", "A100-80G"),
    (r"\bA100\b.*\b40GB\b", "A100-40G"),
    (r"\bA800\b.*\b80GB\b", "A800-80G"),
    (r"\bV100-SXM2-32GB$", "V100-32G"),
    (r"\bRTX 4090$", "RTX-4090"),
)


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
