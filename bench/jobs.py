"""Alternating A/B jobs for the multi-rank benchmarks: each job is a fresh
`torchrun --nproc-per-node N` of bench/worker.py (so peak RSS is per job); jobs run alternately,
round after round, so machine noise spreads over all of them. Reports the median step time (first
step of each job dropped), its ratio to the peer, and rank 0's peak RSS."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--model", default="small")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=1, help="pipelines: micro-batches per step")
    return p


def run_job(impl: str, args, out_dir: str) -> dict:
    out = os.path.join(out_dir, f"{impl}.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           os.path.join(os.path.dirname(__file__), "worker.py"), "--impl", impl, "--steps", str(args.steps),
           "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch), "--model", args.model,
           "--micro-batches", str(args.micro_batches), "--out", out]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"{impl} failed:\n{result.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def compare(pairs: list[tuple[str, str, str]], args) -> None:
    """pairs: (label, strata impl, peer impl). Prints the markdown table."""
    impls = list(dict.fromkeys(i for _, ours, peer in pairs for i in (ours, peer)))
    times = {i: [] for i in impls}
    rss = {i: [] for i in impls}
    with tempfile.TemporaryDirectory() as out_dir:
        for _ in range(args.rounds):
            for impl in impls:
                result = run_job(impl, args, out_dir)
                times[impl] += result["step_times"][1:]
                rss[impl].append(result["peak_rss"])
    median = {i: statistics.median(t) for i, t in times.items()}
    print(f"{args.model} preset, {args.nproc} ranks x 1 thread, gloo, fp32, micro-batch {args.micro_batch} x "
          f"{args.seq_len} tokens, {args.micro_batches} micro-batch(es) per step, {args.rounds} alternating rounds of "
          f"{args.steps} steps\n")
    print("| layout | strata step (s) | peer | peer step (s) | strata / peer | strata peak RSS (MiB) | peer peak RSS (MiB) |")
    print("|---|---|---|---|---|---|---|")
    for label, ours, peer in pairs:
        print(f"| {label} | {median[ours]:.3f} | {peer} | {median[peer]:.3f} | {median[ours] / median[peer]:.2f} | "
              f"{max(rss[ours]) >> 20} | {max(rss[peer]) >> 20} |", flush=True)
