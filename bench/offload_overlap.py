"""How much of an offload tier's copies run beside compute on one accelerator (issue 53): matmuls on
the compute stream while a cpu tier (strata/memory/tiers.py) reads a tensor back from pinned host
memory and writes another one out, both asked for before the matmuls are queued (as ZeRO-3 asks for
the next unit's shard). Under torch.profiler, the fraction of the copies' device time (the
profiler's memcpy activities) that intersects the compute kernels' time, for each direction. Run
with the tier's copy stream (copy_stream.CopyStream) and with the copies on the compute stream, as
the tier made them before it had one (`InlineCopies`, the baseline), on the same device.

  python bench/offload_overlap.py [--matmuls 200] [--size 4096] [--mib 256] [--quick]

bench/gpu_check can call `measure(device, quick)`. On a CPU there is no device stream to overlap
with: the same sequence runs through the tier in quick sizes and the fractions are None, with the
reason and the bytes moved."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from contextlib import nullcontext

import torch

from strata.memory import copy_stream, tiers
from strata.memory.tiers import Tier


class InlineCopies:
    """The baseline: the copies a tier made before it had a copy stream, on its worker thread's
    current stream (the default stream, which compute uses), each waited out with a synchronize of
    that stream on the worker."""

    def __init__(self, device: torch.device):
        self.device = device

    def after_compute(self):
        return None

    def issue(self, after):
        return nullcontext()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def landed(self, *tensors):
        torch.accelerator.current_stream(self.device).synchronize()
        return None


# --- the arithmetic: intervals from the profiler's trace ---------------------------------------------
def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals, as disjoint sorted ones."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def overlap_fraction(copies: list[tuple[float, float]], kernels: list[tuple[float, float]]) -> float | None:
    """The share of the copies' time during which some kernel runs (None without copies)."""
    copy_time = sum(end - start for start, end in merged(copies))
    if copy_time <= 0:
        return None
    busy = merged(kernels)
    shared = sum(max(0.0, min(end, k_end) - max(start, k_start))
                 for start, end in merged(copies) for k_start, k_end in busy)
    return shared / copy_time


def device_intervals(trace_events: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """Kernels and the two directions of memcpy from a chrome trace's events (microseconds)."""
    out: dict[str, list[tuple[float, float]]] = {"kernel": [], "HtoD": [], "DtoH": []}
    for event in trace_events:
        if event.get("ph") != "X" or "dur" not in event:
            continue
        span = (float(event["ts"]), float(event["ts"]) + float(event["dur"]))
        category, name = str(event.get("cat", "")).lower(), str(event.get("name", ""))
        if category == "kernel":
            out["kernel"].append(span)
        elif category == "gpu_memcpy":
            for direction in ("HtoD", "DtoH"):
                if direction in name:
                    out[direction].append(span)
    return out


def summary(trace_events: list[dict]) -> dict:
    spans = device_intervals(trace_events)
    every = [s for group in spans.values() for s in group]
    return {"read_overlap": overlap_fraction(spans["HtoD"], spans["kernel"]),
            "write_overlap": overlap_fraction(spans["DtoH"], spans["kernel"]),
            "copy_ms": {d: sum(e - s for s, e in merged(spans[d])) / 1e3 for d in ("HtoD", "DtoH")},
            "kernel_ms": sum(e - s for s, e in merged(spans["kernel"])) / 1e3,
            "device_span_ms": (max(e for _, e in every) - min(s for s, _ in every)) / 1e3 if every else 0.0}


# --- one run ---------------------------------------------------------------------------------------
def _transfers_beside_matmuls(device: torch.device, copies, matmuls: int, size: int, mib: float) -> dict:
    """A read and a write through a cpu tier, asked for before `matmuls` products of size x size;
    returns the bytes the tier moved."""
    numel = int(mib * 2**20) // 4
    incoming, outgoing = torch.randn(numel, device=device), torch.randn(numel, device=device)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16 if device.type != "cpu" else torch.float32)
    tier = Tier("cpu", "overlap", None, 0, copies=copies)
    tier.reserve("incoming", incoming)
    tier.reserve("outgoing", outgoing)
    tier.evict("incoming", incoming, dirty=True)  # its host copy: what the read brings back
    for write in tier.writes:
        tiers.wait(write)
    before = (sum(tiers.io.read.values()), sum(tiers.io.written.values()))
    read = tier.fetch("incoming", incoming)  # asked for first: runs beside the products
    tier.write("outgoing", outgoing)
    for _ in range(matmuls):
        a = a @ a
        a = a / a.norm()  # stays finite
    tiers.wait(read)
    incoming.add_(1)  # uses what was read, on the compute stream
    for write in tier.writes:
        tiers.wait(write)
    tier.close()
    return {"bytes_read": sum(tiers.io.read.values()) - before[0],
            "bytes_written": sum(tiers.io.written.values()) - before[1]}


def profiled(device: torch.device, copies, matmuls: int, size: int, mib: float) -> dict:
    """One run under torch.profiler (after one to warm up), summarised from its trace."""
    from torch.profiler import ProfilerActivity, profile
    _transfers_beside_matmuls(device, copies, 2, size, mib)
    torch.accelerator.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        moved = _transfers_beside_matmuls(device, copies, matmuls, size, mib)
        torch.accelerator.synchronize()
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return {**summary(events), **moved}


def measure(device: torch.device | str | None = None, quick: bool = False, matmuls: int = 200, size: int = 4096,
            mib: float = 256) -> dict:
    """{"copy_stream": {...}, "inline": {...}} on an accelerator (overlap fractions of reads and
    writes, device times in ms, bytes moved); on a CPU, the sequence in quick sizes through the
    tier, fractions None and the reason."""
    if device is None:
        device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else "cpu"
    device = torch.device(device)
    if quick:
        matmuls, size, mib = min(matmuls, 20), min(size, 1024), min(mib, 16)
    if device.type == "cpu":
        moved = _transfers_beside_matmuls(device, None, min(matmuls, 4), min(size, 64), min(mib, 1 / 16))
        return {"read_overlap": None, "write_overlap": None, **moved,
                "reason": "a CPU device: the tier's copies are plain copies on its worker thread, no device "
                          "stream runs beside compute"}
    return {"copy_stream": profiled(device, copy_stream.CopyStream(device), matmuls, size, mib),
            "inline": profiled(device, InlineCopies(device), matmuls, size, mib),
            "device": torch.accelerator.current_accelerator().type, "matmuls": matmuls, "size": size, "mib": mib}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--matmuls", type=int, default=200)
    p.add_argument("--size", type=int, default=4096, help="the products' side (bf16)")
    p.add_argument("--mib", type=float, default=256, help="MiB read and MiB written")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    print(json.dumps(measure(None, args.quick, args.matmuls, args.size, args.mib), indent=1))


if __name__ == "__main__":
    main()
