"""`strata bench comm`: collective bandwidth like nccl-tests, through strata's own comm layer.

For each operation and message size: the time of one call (iterations back to back after a
warm-up, the slowest rank's mean), the algorithm bandwidth size / time and the bus bandwidth,
which scales it by what each rank must move so that every operation is comparable with the link
(nccl-tests' PERFORMANCE.md): all-reduce 2(n-1)/n, all-gather, reduce-scatter and all-to-all
(n-1)/n, broadcast and send/recv 1. `size` is the whole buffer: all-gather's output,
reduce-scatter's input."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from strata.distributed import comm
from strata.distributed.mesh import ParallelDims, init_distributed, pick_device
from strata.distributed.timing import synchronize_stream
from strata.rules.layout import data_parallel_degree

BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
              "broadcast": lambda n: 1.0, "sendrecv": lambda n: 1.0}
OPS = tuple(BUS_FACTOR)


@dataclass(frozen=True)
class CommBenchConfig:
    """What `strata bench comm` measures on each rank, typed: strata/cli/tools.py builds it from the
    flags and checks it, so this module never sees them. Sizes in bytes; dim: one mesh dimension's
    groups (dp, tp or pp of a tp x pp layout) instead of the world."""
    ops: tuple[str, ...] = OPS
    min_bytes: int = 1024
    max_bytes: int = 64 * 2**20
    factor: int = 4
    iters: int = 10
    dim: str | None = None
    tp: int = 1
    pp: int = 1
    device: str = "auto"
    timeout: float = 300.0
    json: bool = False


def parse_size(text: str) -> int:
    """'64M', '1K', '4096' -> bytes (powers of 1024)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("B")
    scale = units.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in units else text
    try:
        value = int(float(number) * scale)
    except (ValueError, OverflowError):
        raise ValueError(f"{text!r} is not a size (use e.g. 4096, 64K, 16M, 1G)") from None
    if value < 4:
        raise ValueError(f"{text!r}: at least 4 bytes")
    return value


def sizes_between(low: int, high: int, factor: int = 2) -> list[int]:
    sizes, size = [], low
    while size <= high:
        sizes.append(size)
        size *= factor
    return sizes


def _call(op: str, group, name: str, full: torch.Tensor, shard: torch.Tensor):
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if op == "all_reduce":
        comm.all_reduce(full, group, name)
    elif op == "all_gather":
        comm.all_gather(full, shard, group, name)
    elif op == "reduce_scatter":
        comm.reduce_scatter(shard, full, group, name)
    elif op == "all_to_all":
        comm.all_to_all(shard.new_empty(full.numel()), full, group, name)
    elif op == "broadcast":
        comm.broadcast(full, 0, group, name)
    else:  # a ring of send/recv pairs: each rank sends to the next and receives from the previous
        nxt, prv = dist.get_global_rank(group, (rank + 1) % n), dist.get_global_rank(group, (rank - 1) % n)
        comm.send_recv([(full, nxt)], [(shard.new_empty(full.numel()), prv)], group, name).wait()


def measure(op: str, nbytes: int, group=None, name: str = "world", iters: int = 10, warmup: int = 2,
            device: torch.device | None = None) -> dict:
    """One row: op, bytes, seconds per call, algorithm and bus bandwidth (bytes/s). The buffers
    are made on `device` (the group's: NCCL takes device tensors only); the time is the slowest
    rank's, after its stream has finished the calls."""
    device = device or torch.device("cpu")
    n = dist.get_world_size(group)
    elements = max(n, nbytes // 4 // n * n)  # divisible by the group size
    full = torch.ones(elements, device=device)
    shard = torch.ones(elements // n, device=device)
    for _ in range(warmup):
        _call(op, group, name, full, shard)
    comm.barrier(group, name)
    started = time.perf_counter()
    for _ in range(iters):
        _call(op, group, name, full, shard)
    synchronize_stream(device)
    elapsed = torch.tensor([(time.perf_counter() - started) / iters], dtype=torch.float64, device=device)
    comm.all_reduce(elapsed, group, name, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    seconds = elapsed.item()
    size = elements * 4
    return {"op": op, "bytes": size, "ranks": n, "time_s": seconds, "algbw": size / seconds,
            "busbw": size / seconds * BUS_FACTOR[op](n)}


def table(rows: list[dict]) -> str:
    out = ["| op | ranks | size | time (us) | algbw (GB/s) | busbw (GB/s) |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['op']} | {r['ranks']} | {_human(r['bytes'])} | {r['time_s'] * 1e6:,.1f} "
                   f"| {r['algbw'] / 1e9:.3f} | {r['busbw'] / 1e9:.3f} |")
    return "\n".join(out)


def _human(nbytes: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def run(config: CommBenchConfig) -> int:
    """The body of `strata bench comm` on each rank (launched by torchrun)."""
    device = pick_device(config.device)
    _, world, _ = init_distributed(device, config.timeout)
    if world < 2:
        raise ValueError("needs 2 or more ranks")
    group, name = dist.group.WORLD, "world"
    if config.dim:
        dims = ParallelDims(dp=data_parallel_degree(world, tp=config.tp, pp=config.pp), tp=config.tp, pp=config.pp)
        group, name = dims.build_mesh(device.type)[config.dim].get_group(), config.dim
    rows = [measure(op, size, group, name, config.iters, device=device) for op in config.ops
            for size in sizes_between(config.min_bytes, config.max_bytes, config.factor)]
    if dist.get_rank() == 0:
        print(json.dumps({"rows": rows}, indent=1) if config.json else table(rows), flush=True)
    comm.close_streams()
    dist.destroy_process_group()
    return 0
