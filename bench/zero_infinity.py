"""ZeRO-Infinity on this machine: a model whose fp32 states (16 bytes per parameter) do not fit in
its memory, trained with parameters, gradients and Adam's moments on disk. Runs the command of
issue 22 under `/usr/bin/time -v` (one compute thread, the other core left to the I/O thread, as
the calibration measures one process), reads its metrics, asks `strata plan` for the same layout on
the calibrated cpu-local device, and prints the table of docs/benchmarks.md.

  python bench/zero_infinity.py [--model gpt2-1.5b] [--n-layers N] [--steps 3] [--work /tmp/strata-infinity]

Needs `strata calibrate` (it measures the disk the offload files go to; pass --disk-dir if --work
is on another disk), and free disk space of 16 bytes per parameter."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

LAYOUT = "dp=1,zero=3,mb=1,ckpt=full,offload=disk,offload_params=disk"


def train(model: str, steps: int, work: str, n_layers: int | None) -> tuple[list[dict], int, str]:
    metrics = os.path.join(work, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    command = ["strata", "train", "--model", model, "--data", "synthetic", "--steps", str(steps), "--micro-batch", "1",
               "--seq-len", "128", "--zero", "3", "--offload-params", "disk", "--offload", "disk",
               "--checkpointing", "full", "--offload-dir", os.path.join(work, "offload"), "--metrics", metrics,
               "--no-progress"] + (["--n-layers", str(n_layers)] if n_layers else [])
    done = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "strata", *command[1:]], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
    peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))
    with open(metrics) as f:
        records = [json.loads(line) for line in f]
    return [r for r in records if r.get("kind") == "train"], peak_kb * 1024, " ".join(command)


def predicted(model: str, n_layers: int | None) -> dict:
    """The planner's estimate of the same layout (what `strata plan --model M --device cpu-local
    --gpus-per-node 1 --global-batch 1 --seq-len 128 --precision fp32 --layout LAYOUT --json`
    prints, with the block count overridden when the run overrides it)."""
    from strata.model.presets import get_preset
    from strata.plan.cost import estimate
    from strata.plan.inputs import cpu_local_cluster, load_profile, workload
    from strata.plan.report import parse_layout
    cfg = get_preset(model)
    cfg = cfg.with_overrides(n_layers=n_layers) if n_layers else cfg
    work = workload(cfg, 1, 128, "fp32")
    cluster = cpu_local_cluster(1, load_profile(None))
    return estimate(work, cluster, parse_layout(LAYOUT, work, 1)).to_json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-1.5b")
    parser.add_argument("--n-layers", type=int, help="override the preset's blocks (a larger model)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--work", default="/tmp/strata-infinity")
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    records, peak, command = train(args.model, args.steps, args.work, args.n_layers)
    plan = predicted(args.model, args.n_layers)
    gib = 2**30
    print(f"`OMP_NUM_THREADS=1 /usr/bin/time -v {command}`\n")
    print(f"peak resident set (time -v): {peak / gib:.2f} GiB; on disk: " + ", ".join(
        f"{k} {v / 1e9:.1f} GB" for k, v in records[-1]["model_state_breakdown"].items() if v) + "\n")
    print("| step | loss | step s | optimizer step s | I/O wait s (share) | read GB | written GB | peak RSS GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in records:
        io = r["offload"]
        print(f"| {r['step']} | {r['loss']:.4f} | {r['step_time_s']:.1f} | {r['optimizer_step_s']:.1f} | "
              f"{io['io_wait_s']:.1f} ({io['io_wait_s'] / r['step_time_s']:.0%}) | "
              f"{sum(io['read_bytes'].values()) / 1e9:.1f} | {sum(io['written_bytes'].values()) / 1e9:.1f} | "
              f"{r['peak_rss_bytes'] / gib:.2f} |")
    measured = sum(r["step_time_s"] for r in records[1:]) / max(len(records) - 1, 1)  # the first reads a cold cache
    step = plan["step_time_s"]
    print(f"\nplanner (`strata plan --model {args.model} --device cpu-local --gpus-per-node 1 --global-batch 1 "
          f"--seq-len 128 --precision fp32 --layout {LAYOUT}`{', n_layers ' + str(args.n_layers) if args.n_layers else ''}): "
          f"{step:.1f} s per step (compute {plan['compute_s']:.1f} s, "
          f"optimizer {plan['optimizer_s']:.1f} s, transfers {plan['io_seconds']:.1f} s of which "
          f"{plan['exposed_io_seconds']:.1f} s exposed); measured {measured:.1f} s (steps 2..): "
          f"{step / measured - 1:+.0%}; tiers " + ", ".join(f"{k} {v / 1e9:.1f} GB" for k, v in plan["tier_bytes"].items()))


if __name__ == "__main__":
    main()
