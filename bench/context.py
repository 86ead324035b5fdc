"""Context parallelism on this machine, the `small` model (6 blocks of 384, 6 heads), fp32, one
sequence per step.

1. At one sequence length (--seq-len, default 2048): for one process and for cp 2 and 4 (ring)
   and cp 2 (Ulysses; small's 6 heads do not split 4 ways), what a block keeps for backward per
   rank (counted saved-tensor bytes of a 6-block run minus a 2-block run's, over 4, so what the
   blocks share cancels) against one process's / cp (+ Ulysses' own terms,
   strata/rules/context.extra_activation_elements); the bytes a rank sends over the cp group per
   step (counted by strata/distributed/comm.py) against strata/rules/context.py; the step time
   against one process's (median of the steps after the first).
2. The longest sequence (powers of two from 1024) whose step fits a memory budget per rank
   (--budget-gib, default 1: what strata counts a rank holding, model states + peak activations,
   as a device's memory would hold them), with and without cp: each length is trained for one
   step, the next one up is trained too and counted over the budget.

  python bench/context.py [--seq-len 2048] [--budget-gib 1] [--steps 3]
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
from strata.rules.context import attention_traffic, extra_activation_elements

MODEL = "small"
LAYOUTS = [(1, "ring"), (2, "ring"), (2, "ulysses"), (4, "ring")]  # (cp, mode)


def train(cp: int, mode: str, seq_len: int, steps: int, layers: int | None = None) -> list[dict]:
    """Rank 0's step records of a fresh `strata train` job."""
    with tempfile.TemporaryDirectory() as work:
        command = [sys.executable, "-m", "strata", "train", "--model", MODEL, "--seq-len", str(seq_len),
                   "--max-seq-len", str(seq_len), "--micro-batch", "1", "--global-batch", "1", "--steps", str(steps),
                   "--eval-batches", "1", "--no-progress", "--metrics", os.path.join(work, "metrics.jsonl")]
        if cp > 1:
            command += ["--nproc", str(cp), "--cp", str(cp), "--cp-mode", mode]
        if layers is not None:
            command += ["--n-layers", str(layers)]
        subprocess.run(command, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        with open(os.path.join(work, "metrics.jsonl")) as f:
            return [r for r in map(json.loads, f) if r.get("kind") == "train"]


def per_layer(cp: int, mode: str, seq_len: int) -> float:
    six, two = (train(cp, mode, seq_len, 1, layers)[-1]["peak_activation_bytes"] for layers in (6, 2))
    return (six - two) / 4


def held(record: dict) -> float:
    return record["model_state_bytes"] + record["peak_activation_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--budget-gib", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    model = get_preset(MODEL)
    print(f"`python bench/context.py --seq-len {args.seq_len} --budget-gib {args.budget_gib} --steps {args.steps}`")
    print()
    print("| cp | mode | activation bytes/layer/rank (counted) | formula | cp bytes/rank/step (counted) | formula "
          "| step (s) | step / 1 process |")
    print("|---|---|---|---|---|---|---|---|")
    whole = per_layer(1, "ring", args.seq_len)
    base = None
    for cp, mode in LAYOUTS:
        records = train(cp, mode, args.seq_len, args.steps)
        step = statistics.median(r["step_time_s"] for r in records[1:])
        base = base or step
        counted = whole if cp == 1 else per_layer(cp, mode, args.seq_len)
        expected = whole / cp + extra_activation_elements(model, cp, mode, 1, args.seq_len) * 4
        sent = sum(v for k, v in records[-1]["comm_bytes_by_op"].items() if k.endswith("/cp"))
        forward, backward = attention_traffic(model, cp, mode, 1, args.seq_len, 4, 4)
        print(f"| {cp} | {mode if cp > 1 else '-'} | {counted:,.0f} | {expected:,.0f} | {sent:,.0f} | "
              f"{model.n_layers * (forward + backward):,.0f} | {step:.2f} | {step / base:.2f} |", flush=True)
    print()
    budget = args.budget_gib * 2**30
    print(f"Longest sequence within {args.budget_gib:g} GiB per rank (model states + peak activations, counted):")
    print()
    print("| cp | mode | longest seq | its bytes/rank | its peak RSS/rank (GiB) | its step (s) | next (counted) |")
    print("|---|---|---|---|---|---|---|")
    for cp, mode in LAYOUTS:
        seq, fitting = 1024, None
        while True:
            record = train(cp, mode, seq, 1)[-1]
            if held(record) > budget:
                break
            fitting, seq = (seq, record), seq * 2
        if fitting is None:
            print(f"| {cp} | {mode} | none from 1024 | | | | {seq}: {held(record):,.0f} |", flush=True)
            continue
        length, fit = fitting
        print(f"| {cp} | {mode if cp > 1 else '-'} | {length} | {held(fit):,.0f} | {fit['peak_rss_bytes'] / 2**30:.2f} "
              f"| {fit['step_time_s']:.1f} | {seq}: {held(record):,.0f} |", flush=True)


if __name__ == "__main__":
    main()
