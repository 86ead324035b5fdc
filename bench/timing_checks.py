"""What the test suite does not assert, because it depends on how busy the machine is: timings,
bandwidths and resident memory, each against what it should be. The suite checks the counted
quantities behind them (bytes sent, bytes held, the schedule's idle time on a virtual clock); this
script checks that the wall clock and the kernel agree, on a quiet machine.

    python bench/timing_checks.py [--only NAME ...]

Each check prints one line: its name, what it measured, what it expected, and ok or OFF. The
two-node link check needs root (network namespaces, as tests/test_multinode.py) and is skipped
without it."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import netns  # noqa: E402 - the tests' two namespaces

from strata.config import train_config  # noqa: E402
from strata.model.presets import get_preset  # noqa: E402
from strata.model.transformer import build_model  # noqa: E402
from strata.plan.cost import estimate  # noqa: E402
from strata.plan.inputs import build_cluster, workload  # noqa: E402
from strata.rules.layout import Layout  # noqa: E402
from strata.tools.calibrate_inference import decode_seconds  # noqa: E402
from strata.tools.commbench import BUS_FACTOR, measure  # noqa: E402
from strata.train.trainer import train  # noqa: E402

from distributed import free_port, run_on_ranks  # noqa: E402 - the tests' process harness

SIZE = 64 * 2**20
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


def _report(name: str, measured: str, expected: str, ok: bool) -> bool:
    print(f"{name:32} measured {measured:40} expected {expected:32} {'ok' if ok else 'OFF'}", flush=True)
    return ok


class JobFailed(Exception):
    """A command a check runs exited non-zero: the check fails, saying which and why."""


def _strata(*args, **kwargs):
    result = subprocess.run([sys.executable, "-m", "strata", *map(str, args)], capture_output=True, text=True,
                            env=ENV, **kwargs)
    if result.returncode:
        last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
        raise JobFailed(f"`strata {args[0]}` exited {result.returncode}: {last}")
    return result


# --- bus bandwidth: the benchmark against a plain timed all-reduce -----------------------------------
def _bench_and_direct(rounds):
    bench, direct = [], []
    tensor = torch.ones(SIZE // 4)
    for _ in range(rounds):
        bench.append(measure("all_reduce", SIZE, dist.group.WORLD, "world", iters=3)["busbw"])
        dist.barrier()
        started = time.perf_counter()
        for _ in range(3):
            dist.all_reduce(tensor)
        seconds = torch.tensor([(time.perf_counter() - started) / 3], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        direct.append(SIZE / seconds.item() * BUS_FACTOR["all_reduce"](dist.get_world_size()))
    return statistics.median(bench), statistics.median(direct)


def bus_bandwidth() -> bool:
    bench, direct = run_on_ranks(_bench_and_direct, 2, 9, timeout=300)[0]
    return _report("bench comm vs direct all-reduce", f"{bench / 1e9:.3f} GB/s", f"{direct / 1e9:.3f} GB/s (10%)",
                   abs(bench / direct - 1) <= 0.10)


# --- resident memory: it falls as ZeRO shards more, and with the moments on disk ------------------------
def _peak(zero, offload="none", global_batch=4):
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: freed memory goes back at once
    s = train(train_config(model="small", steps=2, global_batch=global_batch, micro_batch=1, seq_len=32, zero=zero,
                          bucket_mb=4, offload=offload, progress=False, peak_flops=1e10, eval_batches=1))
    record = s["records"][-1]
    return record["peak_mem_bytes"], record["model_state_breakdown"]


def rss_by_zero_stage() -> bool:
    peaks = [max(p for p, _ in run_on_ranks(_peak, 4, zero, timeout=300)) for zero in range(4)]
    return _report("peak RSS by ZeRO stage 0-3", ", ".join(f"{p >> 20} MiB" for p in peaks), "falling",
                   peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4)


def rss_with_disk_offload() -> bool:
    kept = run_on_ranks(_peak, 2, 1, "none", 2, timeout=300)
    offloaded = run_on_ranks(_peak, 2, 1, "disk", 2, timeout=300)
    saved = min(k[0] - o[0] for k, o in zip(kept, offloaded))
    moments = kept[0][1]["optimizer"]  # this rank's ZeRO-1 shard of Adam's moments
    return _report("RSS saved by --offload disk", f"{saved >> 20} MiB", f">= 70% of {moments >> 20} MiB moments",
                   saved >= 0.7 * moments)


# --- decode time: the calibrated serving plan against strata's loop -----------------------------------
def calibrated_decode() -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        profile = os.path.join(tmp, "profile.json")
        _strata("calibrate", "--inference", "--out", profile)
        model, ratios = build_model(get_preset("small"), seed=0), []
        for batch in (1, 4):
            planned = _strata("plan", "--inference", "--model", "small", "--device", "cpu-local", "--gpus-per-node", 1,
                              "--precision", "fp32", "--profile", profile, "--context", 36, "--batch", batch, "--json")
            predicted = json.loads(planned.stdout)["layouts"][0]["token_latency_s"]
            ratios.append(predicted / decode_seconds(model, batch=batch))
    return _report("predicted / measured decode", ", ".join(f"{r:.2f}" for r in ratios), "0.65-1.5 at batch 1, 4",
                   all(0.65 < r < 1.5 for r in ratios))


def latency_line() -> bool:
    result = _strata("bench", "generate", "--model", "small", "--prompt-ids", "1,2,3", "--lengths", "4,16,48",
                     "--runs", 2, "--json", "--threads", 1)
    fit = next(f for f in json.loads(result.stdout)["fits"] if f["engine"] == "strata")
    return _report("decode latency against length", f"R² {fit['r2']:.3f}", "a line: R² >= 0.9", fit["r2"] >= 0.9)


# --- a shaped link between two network namespaces: the all-reduce time against the planner -----------
def link_all_reduce() -> bool:
    if not netns.available():
        print(f"{'1 Gbit/s link all-reduce':32} skipped: needs root and `ip netns`", flush=True)
        return True
    with netns.two_nodes("t", "10.233.7") as nodes:
        netns.shape(nodes, "1gbit", "512kb")
        return _train_over(nodes)


def _train_over(nodes) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = os.path.join(tmp, "hosts")
        with open(hostfile, "w") as f:
            f.write("".join(f"{ip} slots=1\n" for _, ip, _ in nodes))
        port = str(free_port())
        args = ["train", "--model", "small", "--seq-len", "16", "--micro-batch", "1", "--steps", "4", "--no-progress",
                "--eval-batches", "1", "--peak-flops", "1e11"]
        jobs = [subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "strata", "launch", "--hostfile",
                                  hostfile, "--master-port", port, "--", *args, "--metrics", f"{tmp}/n{i}.jsonl"],
                                 env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for i, (ns, _, _) in enumerate(nodes)]
        for i, job in enumerate(jobs):
            if job.wait(timeout=300):
                raise JobFailed(f"node {i}'s `strata launch` exited {job.returncode}")
        records = [r for r in map(json.loads, open(f"{tmp}/n0.jsonl")) if r["kind"] == "train"]
    measured = sorted(r["comm_seconds_by_op"]["all_reduce/dp"] for r in records[1:])[1]  # median of steps 2-4
    predicted = estimate(workload(get_preset("small"), 2, 16, "fp32"),
                         build_cluster("A100-80G", 2, 1, None, "0.125"), Layout(dp=2)).comm_seconds["dp"]
    return _report("1 Gbit/s link all-reduce", f"{measured:.3f} s per step", f"{predicted:.3f} s (15%)",
                   abs(measured / predicted - 1) <= 0.15)


CHECKS = {"bus_bandwidth": bus_bandwidth, "rss_by_zero_stage": rss_by_zero_stage,
          "rss_with_disk_offload": rss_with_disk_offload, "calibrated_decode": calibrated_decode,
          "latency_line": latency_line, "link_all_reduce": link_all_reduce}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), help="run these checks only")
    args = parser.parse_args()
    results = []
    for name in args.only or CHECKS:
        try:
            results.append(CHECKS[name]())
        except JobFailed as failed:  # one broken command fails its check, not the others
            results.append(_report(name, "failed", str(failed), False))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
