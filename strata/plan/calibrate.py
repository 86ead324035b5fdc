"""`strata calibrate`: measure this machine so the planner can predict it (`--device cpu-local`).

For 1, 2, 4, ... up to --nproc processes running at once (through torchrun, as training runs):
- the matmul rate each process gets while all of them compute (they share the cores);
- for every collective the planner uses (all-reduce, all-gather, reduce-scatter, send/recv) on a
  group of that size, the time of messages from 64 KiB to 16 MiB, fitted as latency + bytes /
  bandwidth (bytes of the whole tensor, so the fit holds the ring's factors);
then, on one process, the memory bandwidth (a large copy) and the efficiency: the FLOP/s a real
training step of --model reaches over the matmul rate. The profile is JSON, by default in
~/.cache/strata/calibration.json."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

MESSAGE_BYTES = [2**k for k in range(16, 25, 2)]  # 64 KiB .. 16 MiB
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send")


def matmul_rate(seconds: float = 1.0, n: int = 512) -> float:
    """fp32 FLOP/s of this process on square matmuls of transformer-like size."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        torch.mm(a, b)
        done += 1
    return done * 2 * n**3 / (time.perf_counter() - started)


def _time_op(op: str, nbytes: int, repeats: int) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    elements = nbytes // 4
    full = torch.ones(elements - elements % world)
    shard = torch.ones(full.numel() // world)
    times = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        if op == "all_reduce":
            dist.all_reduce(full)
        elif op == "all_gather":
            dist.all_gather_into_tensor(full, shard)
        elif op == "reduce_scatter":
            dist.reduce_scatter_tensor(shard, full)
        elif rank == 0:  # send: rank 0 to rank 1, the others idle
            dist.send(full, 1)
        elif rank == 1:
            dist.recv(full, 0)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def fit(points: list[tuple[float, float]]) -> dict:
    """Least squares time = latency + bytes / bandwidth."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-15)
    return {"latency_s": max(0.0, my - slope * mx), "bandwidth": 1 / slope}


def worker(out: str) -> None:
    """One rank of a calibration group (launched by torchrun)."""
    from strata.distributed.mesh import init_distributed, pick_device
    torch.set_num_threads(1)
    init_distributed(pick_device("cpu"), 120)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        dist.barrier()
    rate = torch.tensor([matmul_rate()], dtype=torch.float64)
    collectives = {}
    if world > 1:
        dist.all_reduce(rate)
        rate /= world
        for op in OPS:
            points = [(nbytes, _time_op(op, nbytes, 5)) for nbytes in MESSAGE_BYTES]
            collectives[op] = fit(points)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"matmul_flops": rate.item(), "collectives": collectives}, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def memory_bandwidth() -> float:
    src = torch.ones(64 * 2**20)  # 256 MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        started = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - started)
    return 2 * src.numel() * 4 / min(times)  # read + write


def step_efficiency(model: str, rate: float) -> float:
    """FLOP/s of a real fp32 training step of `model` (one process) over the matmul rate."""
    from strata.config import TrainConfig
    from strata.train.trainer import train
    cfg = TrainConfig(model=model, seq_len=128, micro_batch=4, steps=4, progress=False, peak_flops=1e12, eval_batches=1)
    summary = train(cfg)
    step = statistics.median(summary["step_times"][1:])
    flops = cfg.micro_batch * 128 * summary["model"].cfg.flops_per_token(128)
    return flops / step / rate


def calibrate(max_procs: int, model: str, out: str) -> dict:
    from strata.distributed.launch import launch_local
    profile = {"device": "cpu-local", "cores": os.cpu_count(), "memory_bytes": _total_memory(),
               "matmul_flops": {}, "collectives": {op: {} for op in OPS}}
    sizes = [1] + [n for n in (2, 4, 8, 16) if n <= max_procs]
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            part = os.path.join(tmp, f"{n}.json")
            if n == 1:
                worker(part)
            else:
                code = launch_local(n, ["calibrate", "--worker", part])
                if code != 0:
                    raise RuntimeError(f"calibration on {n} processes failed (exit code {code})")
            with open(part) as f:
                measured = json.load(f)
            profile["matmul_flops"][str(n)] = measured["matmul_flops"]
            for op, values in measured["collectives"].items():
                profile["collectives"][op][str(n)] = values
            print(f"{n} process{'es' if n > 1 else ''}: {measured['matmul_flops'] / 1e9:.1f} GFLOP/s each"
                  + "".join(f"; {op} {v['latency_s'] * 1e6:.0f} us + {v['bandwidth'] / 1e9:.2f} GB/s"
                            for op, v in measured["collectives"].items()), flush=True)
    torch.set_num_threads(1)
    profile["memory_bandwidth"] = memory_bandwidth()
    profile["efficiency"] = step_efficiency(model, profile["matmul_flops"]["1"])
    profile["efficiency_model"] = model
    print(f"memory bandwidth {profile['memory_bandwidth'] / 1e9:.1f} GB/s; a {model} training step reaches "
          f"{profile['efficiency']:.0%} of the matmul rate", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(profile, f, indent=1)
    print(f"wrote {out}")
    return profile


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 * 2**30


if __name__ == "__main__":
    worker(sys.argv[1])
