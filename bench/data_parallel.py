"""strata's data parallelism and ZeRO against the peers, on 2 ranks of this machine.

Each job is a fresh `torchrun --nproc-per-node 2` of bench/dp_worker.py (so peak RSS is per job);
jobs run alternately, round after round, so machine noise spreads over all of them. Reports the
median step time (first step of each job dropped), its ratio to the peer at the same layout, and
rank 0's peak RSS.

  python bench/data_parallel.py [--rounds 2] [--steps 6]     (DeepSpeed: pip install deepspeed)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile

PAIRS = [("strata-z0", "ddp"), ("strata-z0", "deepspeed-z0"), ("strata-z1", "deepspeed-z1"),
         ("strata-z2", "deepspeed-z2"), ("strata-z3", "deepspeed-z3"), ("strata-z3", "fsdp2")]


def run_job(impl: str, args, out_dir: str) -> dict:
    out = os.path.join(out_dir, f"{impl}.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(os.path.dirname(__file__), "dp_worker.py"), "--impl", impl, "--steps", str(args.steps),
           "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch), "--model", args.model, "--out", out]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"{impl} failed:\n{result.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--model", default="small")
    args = parser.parse_args()
    pairs = [p for p in PAIRS if not p[1].startswith("deepspeed") or importlib.util.find_spec("deepspeed")]
    impls = list(dict.fromkeys(i for pair in pairs for i in pair))
    times = {i: [] for i in impls}
    rss = {i: [] for i in impls}
    with tempfile.TemporaryDirectory() as out_dir:
        for _ in range(args.rounds):
            for impl in impls:
                result = run_job(impl, args, out_dir)
                times[impl] += result["step_times"][1:]
                rss[impl].append(result["peak_rss"])
    median = {i: statistics.median(t) for i, t in times.items()}
    print(f"{args.model} preset, 2 ranks x 1 thread, gloo, fp32, micro-batch {args.micro_batch} x {args.seq_len} "
          f"tokens per rank, {args.rounds} alternating rounds of {args.steps} steps\n")
    print("| layout | strata step (s) | peer | peer step (s) | strata / peer | strata peak RSS (MiB) | peer peak RSS (MiB) |")
    print("|---|---|---|---|---|---|---|")
    for ours, peer in pairs:
        print(f"| ZeRO-{ours[-1]} | {median[ours]:.3f} | {peer} | {median[peer]:.3f} | "
              f"{median[ours] / median[peer]:.2f} | {max(rss[ours]) >> 20} | {max(rss[peer]) >> 20} |")


if __name__ == "__main__":
    main()
