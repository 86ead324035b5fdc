"""What a step reports: throughput, model FLOPs utilisation, memory, and the JSONL file."""

from __future__ import annotations

import json
import os
import platform
import resource
import time
from dataclasses import dataclass

import torch

from strata.distributed import comm
from strata.distributed.timing import synchronize_stream
from strata.files import cache_dir
from strata.model.deepseek_moe import balancing_layers, step_loads, update_biases
from strata.parallel.expert import routed_rows
from strata.plan.hardware import DEVICES, device_for_cuda_name
from strata.rules.dtypes import DTYPES, torch_dtype


def _peak_cache_path() -> str:
    return os.path.join(cache_dir(), "peak_flops.json")


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 2048, repeats: int = 6) -> float:
    """FLOP/s of a square matmul on this device with this process's threads: the peak that MFU is
    measured against where no datasheet number applies (a CPU). The best of several timed runs, as
    a peak should be; a single short timing is easily caught by a frequency ramp or a neighbour."""
    # A dtype without fast kernels (fp16 on most CPUs runs ~30x slower) would take minutes at full
    # size: time a small matmul first and shrink the size so one product takes ~0.2 s at most.
    small = torch.randn(256, 256, device=device).to(dtype)
    small @ small
    synchronize_stream(device)
    start = time.perf_counter()
    small @ small
    synchronize_stream(device)
    size = matmul_size_for(2 * 256 ** 3 / max(time.perf_counter() - start, 1e-9), size)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    a @ b  # warm-up: kernels chosen, caches and clocks up
    best = float("inf")
    for _ in range(repeats):
        synchronize_stream(device)
        start = time.perf_counter()
        a @ b
        synchronize_stream(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


def matmul_size_for(rate: float, largest: int = 2048) -> int:
    """The side of the square matmul that takes about 0.2 s at `rate` FLOP/s (2n^3 FLOPs), in
    multiples of 64, between 256 and `largest`."""
    return max(256, min(largest, int((rate * 0.2 / 2) ** (1 / 3)) // 64 * 64))


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """The measured peak, cached per machine, device, dtype and thread count (measured once)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    key = f"{platform.node()}|{name}|{dtype}|threads={torch.get_num_threads()}"
    cache, cache_path = {}, _peak_cache_path()
    if os.path.isfile(cache_path):
        try:
            with open(cache_path, "rb") as f:
                cache = json.loads(f.read())
        except (OSError, ValueError):  # unreadable: measure again and rewrite it
            cache = {}
        cache = cache if isinstance(cache, dict) else {}
    if key not in cache:
        cache[key] = measure_matmul_flops(device, dtype)
        os.makedirs(os.path.dirname(cache_path), exist_ok=True)
        tmp = f"{cache_path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(cache, f, indent=1)
        os.replace(tmp, cache_path)
    return cache[key]


@dataclass(frozen=True)
class Peak:
    """The FLOP/s MFU divides by, and where it came from: "flag" (--peak-flops), "table:<entry>"
    (strata/plan/hardware.py's dense rate for the detected CUDA device), or "measured" (a timed
    matmul: the CPU, or a CUDA device or dtype the table lacks, `note` saying which)."""
    flops: float
    source: str
    note: str | None = None


def mfu_peak(device: torch.device, dtype_name: str, flag: float | None = None) -> Peak:
    """The peak a run's MFU is measured against. On a GPU a matmul timed from the host reads
    1.5-2.5x above what the device sustains in a step (an H100's measured bf16 matmul against its
    989 TFLOP/s datasheet rate): the datasheet's dense rate for the run's compute dtype is the
    denominator there (bf16 and fp16 under autocast: their 16-bit rate; fp32: the plain, non-TF32
    rate, as strata leaves TF32 off)."""
    if flag:
        return Peak(flag, "flag")
    if device.type != "cuda":
        return Peak(device_peak(device, dtype_name), "measured")
    name = torch.cuda.get_device_name(device)
    entry = device_for_cuda_name(name)
    rate = DEVICES[entry].peak_flops.get(dtype_name) if entry else None
    if rate:
        return Peak(rate, f"table:{entry}")
    note = (f"{name} is not in the device table" if entry is None
            else f"the device table has no {dtype_name} rate for {entry}")
    return Peak(device_peak(device, dtype_name), "measured", f"{note}: MFU divides by a measured matmul, which reads "
                "high on a GPU; --peak-flops sets the datasheet's rate")


def device_peak(device: torch.device, dtype_name: str) -> float:
    """The measured peak for a run in this dtype: `mfu_peak`'s where no datasheet applies. Under
    autocast (bf16, fp16) it is at least the fp32 rate: where the 16-bit kernels are slower (fp16 on
    most CPUs), autocast's matmuls do not run below what fp32 would give, and MFU must not read
    above 1."""
    if not DTYPES[dtype_name].autocast:
        return peak_flops(device, torch_dtype(dtype_name))
    return max(peak_flops(device, torch_dtype(dtype_name)), peak_flops(device, torch.float32))


def peak_memory_bytes(device: torch.device) -> int:
    """Max allocated on CUDA; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class AllocatorStats:
    """What the CUDA caching allocator says at a step's end: the bytes it reserves from the device
    (`memory_reserved`), its cudaMalloc retries since the run started (`num_alloc_retries`: a failed
    cudaMalloc that freed the cache and tried again, the sign of a run at the edge of the memory)
    and the largest allocation. The allocator's statistics count bytes and blocks but keep no
    largest allocation, so that one is the largest segment (cudaMalloc) it has held during the run,
    from its snapshot: an allocation of more than 10 MiB gets a segment of its own, its size rounded
    up to 2 MiB; smaller ones share 2 or 20 MiB segments, and with expandable_segments a segment
    grows to hold many; an upper bound, then, close for the large tensors that decide a peak. The
    snapshot is read only after a step in which the allocator called cudaMalloc (a count in its
    statistics), so a run in its steady state reads one dict per step. A CPU has no such allocator:
    None for all three."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.device_allocs = None  # cudaMalloc calls counted when the snapshot was last read
        self.largest_segment = 0
        self.retries_before = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if self.cuda else 0

    def read(self) -> dict:
        if not self.cuda:
            return {"memory_reserved_bytes": None, "alloc_retries": None, "largest_alloc_bytes": None}
        stats = torch.cuda.memory_stats(self.device)
        device_allocs = stats.get("num_device_alloc", stats.get("segment.all.allocated", 0))
        if device_allocs != self.device_allocs:
            self.device_allocs = device_allocs
            self.largest_segment = max(self.largest_segment, largest_segment_bytes(self.device))
        return {"memory_reserved_bytes": stats.get("reserved_bytes.all.current", 0),
                "alloc_retries": stats.get("num_alloc_retries", 0) - self.retries_before,
                "largest_alloc_bytes": self.largest_segment}


def largest_segment_bytes(device: torch.device) -> int:
    """The largest segment the CUDA caching allocator holds on `device` now (its snapshot, without
    the allocation history's traces where this torch can leave them out)."""
    try:
        segments = torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:  # a torch before include_traces: its snapshot has no traces unless recording
        segments = torch.cuda.memory_snapshot()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return max((s["total_size"] for s in segments if s.get("device", index) == index), default=0)


class MetricsWriter:
    """One JSON object per line; only rank 0 writes. A run resumed at step k continues its file:
    records of later steps (written before a crash, and about to be replayed) are dropped first, so
    every step appears once."""

    def __init__(self, path: str | None, enabled: bool, resume_step: int = 0):
        self.file = None
        if path and enabled:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            if resume_step > 0 and os.path.isfile(path):
                _keep_records_up_to(path, resume_step)
            # unbuffered, one write a record: someone following the file (tail -f, a dashboard)
            # never sees a record split across two writes, as a text buffer would split a long one
            self.file = open(path, "ab" if resume_step > 0 else "wb", buffering=0)

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write((json.dumps(record) + "\n").encode())

    def close(self) -> None:
        if self.file:
            self.file.close()


def _keep_records_up_to(path: str, step: int) -> None:
    """Rewrite a metrics file (atomically) without the records of steps after `step`; a line that
    is not a record (cut short by a crash) goes too."""
    kept = []
    with open(path, "rb") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("step", 0) <= step:
                kept.append(line if line.endswith(b"\n") else line + b"\n")
    with open(path + ".tmp", "wb") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


def balance_experts(run) -> None:
    """DeepSeek-V3's balancing (strata/model/deepseek_moe.py): each balancing layer's assignments per
    expert this step, summed over the ranks that routed this stage's tokens (dp x cp; tensor-parallel
    ranks route the same ones), move its bias one step. One all-reduce, at the same point of every
    rank's step, so every copy of a bias stays equal."""
    layers = balancing_layers(run.model)
    if not layers:
        return
    loads = step_loads(layers, run.device)
    if run.dp_group is not None:
        comm.all_reduce(loads, run.dp_group, "dp")
    update_biases(layers, loads)


def routed(run, micro_batches: int) -> dict:
    """What the MoE layers routed in a step, over every layer, micro-batch and rank: the weighted
    auxiliary loss (its mean over micro-batches and data-parallel ranks, summed over the stages'
    layers), tokens per expert and dropped assignments (sums); and this rank's all-to-all rows to
    and from each expert-parallel rank (with --ep > 1)."""
    taken = run.model.router_losses.take()
    n, device = run.model_cfg.n_experts, run.device
    zero = torch.zeros(1, dtype=torch.float64, device=device)
    sums = torch.cat([zero if taken["aux_loss"] is None else taken["aux_loss"].double().reshape(1).to(device),
                      zero.repeat(n) if taken["expert_load"] is None else taken["expert_load"].double().to(device),
                      zero if taken["dropped"] is None else taken["dropped"].double().reshape(1).to(device)])
    for group, name in ((run.pp_group, "pp"), (run.dp_group, "dp")):
        if group is not None:
            comm.all_reduce(sums, group, name)
    values = sums.tolist()  # one read of the device for all of it
    out = {"aux_loss": values[0] / (micro_batches * run.dims.dp), "expert_load": [int(v) for v in values[1:1 + n]],
           "dropped_tokens": int(values[-1])}
    if routed_rows.dispatches:
        out["all_to_all_rows"] = {"sent": routed_rows.sent, "received": routed_rows.received,
                                  "dispatches": routed_rows.dispatches}
    return out
