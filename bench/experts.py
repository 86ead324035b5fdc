"""Expert parallelism on this machine: `tiny-moe` (4 experts, top-2) trained with its experts whole
on every rank (ep 1: the experts' gradients all-reduced with the rest) and split over 2 and 4 of
the data-parallel ranks (ep 2, ep 4: tokens travel to their experts and back by all-to-all), on 2
and 4 ranks, the layouts alternating round by round.

For each layout: the step time (median over the steps after the first, and its ratio to ep 1 on
the same ranks), the all-to-all bytes a rank sends per step (counted by strata/distributed/comm.py,
against strata/rules/experts.all_to_all_bytes of the rows the rank routed), the seconds the rank
spent in all-to-alls, the gradient reductions' bytes, and the model-state bytes a rank holds.

  python bench/experts.py [--rounds 3] [--steps 5] [--seq-len 64] [--micro-batch 4]
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
from strata.rules.experts import all_to_all_bytes

LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]  # (ranks, ep)
MODEL = "tiny-moe"


def run(ranks: int, ep: int, args) -> list[list[dict]]:
    """Every rank's step records (each rank writes its own metrics file)."""
    with tempfile.TemporaryDirectory() as work:
        command = [sys.executable, "-m", "strata", "train", "--model", MODEL, "--nproc", str(ranks), "--ep", str(ep),
                   "--steps", str(args.steps), "--micro-batch", str(args.micro_batch),
                   "--global-batch", str(args.micro_batch * 4), "--seq-len", str(args.seq_len), "--eval-every", "0",
                   "--no-progress", "--metrics", os.path.join(work, "metrics.jsonl")]
        subprocess.run(command, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        with open(os.path.join(work, "metrics.jsonl")) as f:
            return [r for r in map(json.loads, f) if r.get("kind") == "train"]


def formula(record: dict, ep: int) -> float:
    """rules/experts.all_to_all_bytes of rank 0's routed rows (linear in them), one count exchange per dispatch."""
    if ep == 1:
        return 0.0
    cfg, rows = get_preset(MODEL), record["all_to_all_rows"]
    counts = all_to_all_bytes([0] * ep, [0] * ep, 0, cfg.d_model, 4, cfg.n_experts, ep)
    return all_to_all_bytes(rows["sent"], rows["received"], 0, cfg.d_model, 4, cfg.n_experts, ep) + \
        (rows["dispatches"] - 1) * counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args()
    times: dict[int, list[float]] = {i: [] for i in range(len(LAYOUTS))}
    last: dict[int, dict] = {}
    for _ in range(args.rounds):
        for i, (ranks, ep) in enumerate(LAYOUTS):
            records = run(ranks, ep, args)
            times[i] += [r["step_time_s"] for r in records[1:]]  # the first step warms up
            last[i] = records[-1]
    print(f"`python bench/experts.py --rounds {args.rounds} --steps {args.steps} --seq-len {args.seq_len} "
          f"--micro-batch {args.micro_batch}`: {MODEL}, {args.micro_batch * 4} sequences of {args.seq_len} per step")
    print()
    print("| ranks | ep | step (s) | step / ep 1 | all-to-all bytes/rank/step (counted) | formula | all-to-all s "
          "| dp + edp reduction bytes | model-state bytes/rank |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, (ranks, ep) in enumerate(LAYOUTS):
        record, step = last[i], statistics.median(times[i])
        base = statistics.median(times[LAYOUTS.index((ranks, 1))])
        by_op = record["comm_bytes_by_op"]
        a2a = by_op.get("all_to_all/ep", 0.0)
        reductions = sum(v for k, v in by_op.items() if k.split("/")[1] in ("dp", "edp") and "all_to_all" not in k)
        seconds = record["comm_seconds_by_op"].get("all_to_all/ep", 0.0)
        print(f"| {ranks} | {ep} | {step:.3f} | {step / base:.2f} | {a2a:,.0f} | {formula(record, ep):,.0f} | "
              f"{seconds:.3f} | {reductions:,.0f} | {record['model_state_bytes']:,.0f} |")


if __name__ == "__main__":
    main()
