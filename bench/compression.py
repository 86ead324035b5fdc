"""PowerSGD (--compress powersgd) against the uncompressed all-reduce, in two measurements:

  loss  the `small` model on Shakespeare (BPE 8,192), 2 data-parallel processes, bf16, 300 steps of
        8 x 256 tokens: the validation curves as a plot, the final losses and the bytes a step sends
  link  two "nodes" (network namespaces joined by a veth pair, tests/netns.py; needs root) with the
        link limited by tc's token bucket, one process each under `strata launch`: the median step
        time with and without compression, one after the other in the same run

  python bench/compression.py loss [--steps 300] [--out docs/img/compression_val_loss.png]
  python bench/compression.py link [--rate 100mbit] [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
RUNS = {"uncompressed": None, "powersgd rank 4": 4, "powersgd rank 1": 1}  # name: the factors' rank


def flags(rank: int | None, after: int) -> list[str]:
    return [] if rank is None else ["--compress", "powersgd", "--compress-rank", str(rank),
                                    "--compress-after", str(after)]


def _records(path: str, kind: str) -> list[dict]:
    return [r for r in map(json.loads, open(path)) if r["kind"] == kind]


def loss(args) -> None:
    data = os.path.join(args.work, "data")
    if not os.path.isfile(os.path.join(data, "meta.json")):
        subprocess.run([sys.executable, "-m", "strata", "data", "prepare", "--source", "shakespeare",
                        "--tokenizer", "bpe:8192", "--out", data], check=True, env=ENV)
    curves, sent = {}, {}
    for name, rank in RUNS.items():
        metrics = os.path.join(args.work, f"{name.replace(' ', '_')}.jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)
        subprocess.run([sys.executable, "-m", "strata", "train", "--model", "small", "--data", data, "--dtype", "bf16",
                        "--seq-len", "256", "--nproc", "2", "--micro-batch", "4", "--global-batch", "8",
                        "--steps", str(args.steps), "--lr", "2e-3", "--min-lr", "2e-4", "--warmup-steps", "10",
                        "--eval-every", str(max(args.steps // 12, 1)), "--eval-batches", "4", "--grad-clip", "0",
                        "--metrics", metrics, "--no-progress", *flags(rank, 10)], check=True, env=ENV)
        curves[name] = [(r["step"] * 8 * 256, r["val_loss"]) for r in _records(metrics, "eval")]
        sent[name] = _records(metrics, "train")[-1]["comm_bytes_by_op"].get("all_reduce/dp", 0.0)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in curves.items():
        ax.plot([t for t, _ in points], [v for _, v in points], marker="o", markersize=3, label=name)
    ax.set_xlabel("tokens")
    ax.set_ylabel("validation loss")
    ax.set_title(f"small on Shakespeare, dp 2, bf16, {args.steps} steps of 8 x 256 tokens", fontsize=9)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fig.savefig(args.out, dpi=120)
    base = curves["uncompressed"][-1][1]
    print("| run | validation loss at the start | at the end | against uncompressed | all-reduce bytes per step (rank 0) |")
    print("|---|---|---|---|---|")
    for name, points in curves.items():
        print(f"| {name} | {points[0][1]:.3f} | {points[-1][1]:.3f} | {points[-1][1] / base - 1:+.2%} | "
              f"{sent[name] / 1e6:.2f} MB |")
    print(f"plot: {args.out}")


def link(args) -> None:
    import netns
    from timing_checks import free_port
    if not netns.available():
        sys.exit("link: needs root and `ip netns` (two network namespaces joined by a veth pair)")
    results = {}
    with netns.two_nodes("c", "10.233.9") as nodes, tempfile.TemporaryDirectory() as tmp:
        netns.shape(nodes, args.rate, "512kb")
        hostfile = os.path.join(tmp, "hosts")
        with open(hostfile, "w") as f:
            f.write("".join(f"{ip} slots=1\n" for _, ip, _ in nodes))
        for name, rank in RUNS.items():
            port = str(free_port())
            train = ["train", "--model", "small", "--seq-len", "64", "--micro-batch", "2", "--global-batch", "4",
                     "--steps", str(args.steps), "--no-progress", "--eval-batches", "1", *flags(rank, 0)]
            jobs = [subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "strata", "launch",
                                      "--hostfile", hostfile, "--master-port", port, "--", *train,
                                      "--metrics", f"{tmp}/{i}.jsonl"], env=ENV,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    for i, (ns, _, _) in enumerate(nodes)]
            for i, job in enumerate(jobs):
                if job.wait(timeout=1800):
                    sys.exit(f"{name}: node {i}'s `strata launch` exited {job.returncode}")
            steps = _records(f"{tmp}/0.jsonl", "train")[2:]  # past the first steps' warm-up
            results[name] = (statistics.median(r["step_time_s"] for r in steps),
                             statistics.median(r["comm_bytes_by_op"].get("all_reduce/dp", 0.0) for r in steps))
    base = results["uncompressed"][0]
    print(f"| run ({args.rate} link, small, 2 x 2 x 64 tokens a step) | median step | speed-up | "
          f"all-reduce bytes per step |")
    print("|---|---|---|---|")
    for name, (seconds, nbytes) in results.items():
        print(f"| {name} | {seconds:.3f} s | {base / seconds:.2f}x | {nbytes / 1e6:.2f} MB |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["loss", "link"])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", default="docs/img/compression_val_loss.png")
    parser.add_argument("--work", default="/tmp/strata-compression")
    parser.add_argument("--rate", default="100mbit")
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    if args.what == "loss":
        args.steps = args.steps or 300
        loss(args)
    else:
        args.steps = args.steps or 12
        link(args)


if __name__ == "__main__":
    main()
