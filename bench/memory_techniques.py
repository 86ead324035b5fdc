"""The time side of the memory techniques, measured side by side in one process: the step time of
activation checkpointing (full, selective) against none, and bf16 / fp16 autocast against fp32,
on the `small` preset. Runs alternate (A, B, C, A, B, C, ...) so machine noise hits all alike;
the median step time is reported with the saved-activation bytes per step.

  python bench/memory_techniques.py [--rounds 3] [--steps 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from strata.config import train_config
from strata.train.trainer import train

VARIANTS = {
    "fp32, no checkpointing": dict(dtype="fp32"),
    "fp32, selective": dict(dtype="fp32", checkpointing="selective"),
    "fp32, full": dict(dtype="fp32", checkpointing="full"),
    "bf16, no checkpointing": dict(dtype="bf16"),
    "bf16, full": dict(dtype="bf16", checkpointing="full"),
    "fp16, no checkpointing": dict(dtype="fp16"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    times = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, settings in VARIANTS.items():
            cfg = train_config(model="small", seq_len=args.seq_len, micro_batch=args.micro_batch,
                              global_batch=args.micro_batch, steps=args.steps, progress=False, peak_flops=1e12,
                              eval_batches=1, **settings)
            times[name] += train(cfg)["step_times"][1:]
    base = {"fp32": statistics.median(times["fp32, no checkpointing"])}
    print(f"small preset, 1 process x {args.threads} threads, {args.micro_batch} x {args.seq_len} tokens per step, "
          f"{args.rounds} alternating rounds of {args.steps} steps (first dropped), median\n")
    print("| variant | step (s) | vs fp32 without checkpointing |")
    print("|---|---|---|")
    for name in VARIANTS:
        median = statistics.median(times[name])
        print(f"| {name} | {median:.3f} | {median / base['fp32']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
