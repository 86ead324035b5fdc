"""Validation loss after the same number of tokens under 1F1B, PipeDream-2BW and PipeDream: the
`small` model on Shakespeare, 2 pipeline stages (two processes), bf16, 300 steps of 8 x 256 tokens
by default. 1F1B and 2BW run 4 micro-batches of 2 per step; PipeDream, which updates after every
micro-batch, one of 8: the same updates and tokens for all three. Writes the validation curves as a
plot and prints the table of docs/benchmarks.md, with the weight-version bytes each stage stashed.

  python bench/async_loss.py [--steps 300] [--out docs/img/async_val_loss.png] [--work /tmp/strata-async]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

RUNS = {"1f1b": dict(micro_batch=2), "2bw": dict(micro_batch=2), "pipedream": dict(micro_batch=8)}


def train(schedule: str, data: str, metrics: str, steps: int, micro_batch: int) -> None:
    args = ["train", "--model", "small", "--data", data, "--dtype", "bf16", "--seq-len", "256",
            "--nproc", "2", "--pp", "2", "--schedule", schedule, "--micro-batch", str(micro_batch),
            "--global-batch", "8", "--steps", str(steps), "--lr", "2e-3", "--min-lr", "2e-4",
            "--warmup-steps", str(min(10, steps)), "--eval-every", str(max(steps // 12, 1)), "--eval-batches", "4",
            "--grad-clip", "0", "--metrics", metrics, "--no-progress"]
    subprocess.run([sys.executable, "-m", "strata", *args], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="docs/img/async_val_loss.png")
    parser.add_argument("--work", default="/tmp/strata-async")
    args = parser.parse_args()
    data = os.path.join(args.work, "data")
    if not os.path.isfile(os.path.join(data, "meta.json")):
        subprocess.run([sys.executable, "-m", "strata", "data", "prepare", "--source", "shakespeare",
                        "--tokenizer", "bpe:8192", "--out", data], check=True)
    curves, versions, seconds = {}, {}, {}
    for schedule, settings in RUNS.items():
        metrics = os.path.join(args.work, f"{schedule}.jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)
        train(schedule, data, metrics, args.steps, settings["micro_batch"])
        records = [json.loads(line) for line in open(metrics)]
        curves[schedule] = [(r["step"] * 8 * 256, r["val_loss"]) for r in records if r["kind"] == "eval"]
        steps = [r for r in records if r["kind"] == "train"]
        versions[schedule] = steps[-1].get("weight_version_bytes")
        seconds[schedule] = sorted(r["step_time_s"] for r in steps)[len(steps) // 2]

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for schedule, points in curves.items():
        ax.plot([t for t, _ in points], [v for _, v in points], marker="o", markersize=3, label=schedule)
    ax.set_xlabel("tokens")
    ax.set_ylabel("validation loss")
    ax.set_title(f"small on Shakespeare, pp 2, bf16, {args.steps} steps of 8 x 256 tokens", fontsize=9)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print("| schedule | validation loss at the start | at the end | median step (rank 0) | weight versions stashed on rank 0 |")
    print("|---|---|---|---|---|")
    for schedule, points in curves.items():
        stash = f"{versions[schedule][0] / 1e6:.1f} MB" if versions[schedule] else "none"
        print(f"| {schedule} | {points[0][1]:.3f} | {points[-1][1]:.3f} | {seconds[schedule]:.3f} s | {stash} |")
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
