"""Tensor parallelism's four ways of cutting the matrices on this machine: Megatron's 1-D (with and
without sequence parallelism) against Colossal-AI's 2-D, 2.5-D and 3-D, on 4 and 8 ranks, the
`small` model with 8 heads (--n-heads 8: the preset's 6 heads cannot be split 4 or 8 ways by 1-D).

For each layout: bytes a rank sends over its tensor-parallel groups per step (counted by
strata/distributed/comm.py, against strata/rules/tensor_modes.py's formula), activation bytes per
block (counted: the saved-tensor bytes of a 6-block run minus those of a 2-block run, over 4,
against the single process's divided as each mode cuts them: `activation_formula`), and the step
time, as a ratio to 1-D on the same number of ranks, the layouts alternating round by round.

  python bench/tensor_modes.py [--rounds 2] [--steps 4] [--seq-len 128] [--micro-batch 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from strata.model.presets import get_preset
from strata.rules.tensor_modes import grid_of
from strata.rules.tensor_traffic import ElementBytes, step_bytes

LAYOUTS = [  # (ranks, label, flags)
    (4, "1d", ["--tp", "4"]),
    (4, "1d + sp", ["--tp", "4", "--sequence-parallel"]),
    (4, "2d (q=2)", ["--tp", "4", "--tp-mode", "2d"]),
    (8, "1d", ["--tp", "8"]),
    (8, "1d + sp", ["--tp", "8", "--sequence-parallel"]),
    (8, "2.5d (q=2, d=2)", ["--tp", "8", "--tp-mode", "2.5d", "--tp-depth", "2"]),
    (8, "3d (q=2)", ["--tp", "8", "--tp-mode", "3d"]),
]
MODEL = ["--model", "small", "--n-heads", "8"]


def run(ranks: int, flags: list[str], args, n_layers: int | None = None, steps: int | None = None) -> list[dict]:
    with tempfile.TemporaryDirectory() as work:
        metrics = os.path.join(work, "metrics.jsonl")
        command = [sys.executable, "-m", "strata", "train", *MODEL, "--nproc", str(ranks), *flags,
                   "--steps", str(steps or args.steps), "--micro-batch", str(args.micro_batch),
                   "--global-batch", str(args.micro_batch), "--seq-len", str(args.seq_len), "--eval-every", "0",
                   "--no-progress", "--metrics", metrics] + (["--n-layers", str(n_layers)] if n_layers else [])
        subprocess.run(command, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        with open(metrics) as f:
            return [r for r in map(json.loads, f) if r.get("kind") == "train"]


def tp_bytes(record: dict) -> float:
    return sum(v for k, v in record["comm_bytes_by_op"].items() if k.split("/")[1].startswith("tp"))


def formula(label: str, flags: list[str], ranks: int, args) -> float:
    """The formula's bytes per rank per step (one micro-batch), the gradient norm's sum included."""
    model = get_preset("small").with_overrides(n_heads=8)
    mode = flags[flags.index("--tp-mode") + 1] if "--tp-mode" in flags else "1d"
    depth = int(flags[flags.index("--tp-depth") + 1]) if "--tp-depth" in flags else 1
    grid = grid_of(mode, ranks, depth)
    sp = "--sequence-parallel" in flags
    total = step_bytes(model, grid, args.micro_batch * args.seq_len, ElementBytes.uniform(4),
                       sequence_parallel=sp).total
    return total + 2 * (ranks - 1) / ranks * 8  # the gradient norm's fp64 sum of squares


def activation_formula(single_block: float, label: str, flags: list[str], ranks: int, args) -> float:
    """What a rank keeps per block, from the single process's count: 1-D keeps its two norms'
    inputs, outputs and 1/rms whole ((6h + 2) per token, tests/test_tensor_parallel.py) and splits
    the rest t ways; 1-D + SP splits everything t ways; a grid splits everything tp ways but the
    norms' 1/rms (one number per token), which only the sequence split cuts."""
    tokens, h = args.micro_batch * args.seq_len, get_preset("small").d_model
    if "--tp-mode" not in flags:
        whole = 0 if "--sequence-parallel" in flags else (6 * h + 2) * tokens * 4
        return whole + (single_block - whole) / ranks
    mode = flags[flags.index("--tp-mode") + 1]
    depth = int(flags[flags.index("--tp-depth") + 1]) if "--tp-depth" in flags else 1
    rms = 2 * tokens * 4
    return (single_block - rms) / ranks + rms / grid_of(mode, ranks, depth).batch_parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args()
    single = run(1, [], args, steps=1)[0]["peak_activation_bytes"] - run(1, [], args, 2, 1)[0]["peak_activation_bytes"]
    times: dict[int, list[float]] = {i: [] for i in range(len(LAYOUTS))}
    last: dict[int, dict] = {}
    for _ in range(args.rounds):
        for i, (ranks, _, flags) in enumerate(LAYOUTS):
            records = run(ranks, flags, args)
            times[i] += [r["step_time_s"] for r in records[1:]]  # the first step warms up
            last[i] = records[-1]
    print(f"single process: {single / 4:,.0f} activation bytes per block")
    print("| ranks | mode | tp bytes/rank/step (counted) | formula | activation bytes/block/rank (counted) "
          "| formula | step (s) | step / 1d |")
    print("|---|---|---|---|---|---|---|---|")
    for i, (ranks, label, flags) in enumerate(LAYOUTS):
        blocks6 = last[i]["peak_activation_bytes"]
        blocks2 = run(ranks, flags, args, 2, 1)[0]["peak_activation_bytes"]
        per_block = (blocks6 - blocks2) / 4
        step = statistics.median(times[i])
        base = statistics.median(times[next(j for j, (r, name, _) in enumerate(LAYOUTS) if r == ranks and name == "1d")])
        print(f"| {ranks} | {label} | {tp_bytes(last[i]):,.0f} | {formula(label, flags, ranks, args):,.0f} | "
              f"{per_block:,.0f} | {activation_formula(single / 4, label, flags, ranks, args):,.0f} | {step:.3f} | "
              f"{step / base:.2f} |")


if __name__ == "__main__":
    main()
