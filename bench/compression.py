"""PowerSGD (--compress powersgd), 1-bit Adam (--compress onebit) and 0/1 Adam (--compress zeroone)
against the uncompressed all-reduce, in two measurements (and hpZ against ZeRO-3 in a third):

  loss  the `small` model on Shakespeare (BPE 8,192), 2 data-parallel processes, fp32 (--dtype), 300
        steps of 2 x 4 sequences of 256 tokens (--micro-batch: a rank's sequences a step), lr 6e-4
        (--lr; GPT-3 Small's, cosine to a tenth; 2e-3, the default until 2026-12-06, ends the
        uncompressed run no lower, 5.0954 against 5.0912): the validation curves as a plot, the final
        losses and the bytes a step sends. Every compressor compresses fp32 gradients whatever the
        dtype; fp32 is the default because bf16 has no matrix instructions on the AMD EPYC this was
        last run on (22 s a step against fp32's 1.4)
  link  two "nodes" (network namespaces joined by a veth pair, tests/netns.py; needs root) with the
        link limited by tc's token bucket, one process each under `strata launch`: the median step
        time with and without compression, one after the other in the same run (0/1 Adam with
        --var-update-scaler 1, so that a dozen steps reach its compressed steps)

  hpz   the same two nodes, two processes each (4 data-parallel ranks), ZeRO-3 against ZeRO-3 with
        ZeRO++'s hpZ (--hpz-partition-size 2: the backward's gathers inside a node), in one run

  python bench/compression.py loss [--steps 300] [--dtype fp32] [--micro-batch 4] [--lr 6e-4]
                                   [--onebit-warm-up 25] [--out docs/img/compression_val_loss.png]
                                   [--runs uncompressed,0/1 Adam] [--reuse]
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
# name: (--compress, PowerSGD's rank)
RUNS = {"uncompressed": ("none", None), "powersgd rank 4": ("powersgd", 4), "powersgd rank 1": ("powersgd", 1),
        "1-bit Adam": ("onebit", None), "0/1 Adam": ("zeroone", None)}


# the uncompressed run's final validation loss after 300 steps, per --dtype, --micro-batch and --lr
# (2026-12-06; bf16's measured twice, the same both times), what --runs compares with when it leaves
# the uncompressed run out
BASELINES = {("bf16", 4, 2e-3): 5.0775, ("fp32", 4, 2e-3): 5.0954, ("fp32", 4, 6e-4): 5.0912}


def flags(run: tuple[str, int | None], after: int) -> list[str]:
    compress, rank = run
    if compress == "none":
        return []
    if compress == "zeroone":  # no warm-up: its first --var-update-scaler steps all-reduce uncompressed
        return ["--compress", compress]
    return ["--compress", compress, *(["--compress-rank", str(rank)] if rank is not None else []),
            "--compress-after", str(after)]


def warm_up(run: tuple[str, int | None], steps: int, onebit_percent: int) -> int:
    """--compress-after for the loss runs: PowerSGD's 10% of the run (PyTorch's powerSGD_hook: "To
    tune start_powerSGD_iter, we suggest to start with 10% of total training steps", and no less than
    the lr warm-up); for 1-bit Adam `onebit_percent` (--onebit-warm-up), 25 by default, the top of
    DeepSpeed's "15-25% of the total training steps" (its 1-bit Adam tutorial): v must settle before
    it is frozen, and the earlier it freezes the more of the first steps' large gradients it keeps
    (fp32, lr 2e-3, 300 steps: frozen at 15% 5.3321, at 25% 5.2507, against 5.0954 uncompressed)."""
    return steps * (onebit_percent if run[0] == "onebit" else 10) // 100


def dp_bytes(record: dict) -> float:
    """What a step sent over the data-parallel group, every collective (1-bit Adam's all-to-all and
    all-gather, the others' all-reduces)."""
    return sum(nbytes for op, nbytes in record["comm_bytes_by_op"].items() if op.endswith("/dp"))


def _records(path: str, kind: str) -> list[dict]:
    return [r for r in map(json.loads, open(path)) if r["kind"] == kind]


def loss(args) -> None:
    data = os.path.join(args.work, "data")
    if not os.path.isfile(os.path.join(data, "meta.json")):
        subprocess.run([sys.executable, "-m", "strata", "data", "prepare", "--source", "shakespeare",
                        "--tokenizer", "bpe:8192", "--out", data], check=True, env=ENV)
    curves, sent = {}, {}
    for name in args.runs:
        run = RUNS[name]
        setting = f"_{args.dtype}_mb{args.micro_batch}_lr{args.lr:g}" + \
            (f"_after{args.onebit_warm_up}" if RUNS[name][0] == "onebit" else "")
        metrics = os.path.join(args.work, f"{name.replace(' ', '_').replace('/', '-')}{setting}.jsonl")
        if args.reuse and _finished(metrics, args.steps):
            print(f"{name}: reusing {metrics}")
        else:
            _run_loss(args, data, run, metrics)
        curves[name] = [(r["step"] * 2 * args.micro_batch * 256, r["val_loss"]) for r in _records(metrics, "eval")]
        train = _records(metrics, "train")
        sent[name] = (statistics.mean(dp_bytes(r) for r in train), min(dp_bytes(r) for r in train))
    _plot_and_table(args, curves, sent)


def _finished(metrics: str, steps: int) -> bool:
    return os.path.exists(metrics) and any(r["step"] == steps for r in _records(metrics, "eval"))


def _run_loss(args, data: str, run: tuple[str, int | None], metrics: str) -> None:
    if os.path.exists(metrics):
        os.remove(metrics)
    subprocess.run([sys.executable, "-m", "strata", "train", "--model", "small", "--data", data, "--dtype", args.dtype,
                    "--seq-len", "256", "--nproc", "2", "--micro-batch", str(args.micro_batch),
                    "--global-batch", str(2 * args.micro_batch),
                    "--steps", str(args.steps), "--lr", str(args.lr), "--min-lr", str(args.lr / 10), "--warmup-steps", "10",
                    "--eval-every", str(max(args.steps // 12, 1)), "--eval-batches", "4", "--grad-clip", "0",
                    "--metrics", metrics, "--no-progress", *flags(run, warm_up(run, args.steps, args.onebit_warm_up))],
                   check=True, env=ENV)


def _plot_and_table(args, curves: dict, sent: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in curves.items():
        ax.plot([t for t, _ in points], [v for _, v in points], marker="o", markersize=3, label=name)
    ax.set_xlabel("tokens")
    ax.set_ylabel("validation loss")
    ax.set_title(f"small on Shakespeare, dp 2, {args.dtype}, lr {args.lr:g}, {args.steps} steps of 2 x {args.micro_batch} "
                 f"x 256 tokens", fontsize=9)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fig.savefig(args.out, dpi=120)
    base = curves["uncompressed"][-1][1] if "uncompressed" in curves else BASELINES[args.dtype, args.micro_batch, args.lr]
    # bytes over the dp group (rank 0): a compressed step's, and the mean over the run's steps (the
    # warm-up's and 0/1 Adam's steps that update v send the gradients whole)
    print(f"| run | validation loss at the start | at the end | against uncompressed ({base:.4f}) | "
          f"dp bytes, a compressed step | dp bytes per step, mean |")
    print("|---|---|---|---|---|---|")
    for name, points in curves.items():
        print(f"| {name} | {points[0][1]:.3f} | {points[-1][1]:.4f} | {points[-1][1] / base - 1:+.2%} | "
              f"{sent[name][1] / 1e6:.2f} MB | {sent[name][0] / 1e6:.2f} MB |")
    print(f"plot: {args.out}")


def _on_two_nodes(args, prefix: str, subnet: str, slots: int, runs: dict[str, list[str]]):
    """Each run's `small` training (its own flags) under `strata launch` on two network namespaces
    joined by a veth pair shaped to --rate, `slots` processes each; yields (name, the first node's
    train records past the first two steps: their warm-up and --compress-after's)."""
    import netns
    from timing_checks import free_port
    if not netns.available():
        sys.exit(f"{args.what}: needs root and `ip netns` (two network namespaces joined by a veth pair)")
    with netns.two_nodes(prefix, subnet) as nodes, tempfile.TemporaryDirectory() as tmp:
        netns.shape(nodes, args.rate, "512kb")
        hostfile = os.path.join(tmp, "hosts")
        with open(hostfile, "w") as f:
            f.write("".join(f"{ip} slots={slots}\n" for _, ip, _ in nodes))
        for name, extra in runs.items():
            port = str(free_port())
            train = ["train", "--model", "small", "--seq-len", "64", "--steps", str(args.steps), "--no-progress",
                     "--eval-batches", "1", *extra]
            jobs = [subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "strata", "launch",
                                      "--hostfile", hostfile, "--master-port", port, "--", *train,
                                      "--metrics", f"{tmp}/{i}.jsonl"], env=ENV,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    for i, (ns, _, _) in enumerate(nodes)]
            for i, job in enumerate(jobs):
                if job.wait(timeout=1800):
                    sys.exit(f"{name}: node {i}'s `strata launch` exited {job.returncode}")
            yield name, _records(f"{tmp}/0.jsonl", "train")[2:]


def link(args) -> None:
    results = {}
    shape = ["--micro-batch", "2", "--global-batch", "4"]
    runs = {name: [*shape, *flags(run, 2), *(["--var-update-scaler", "1"] if run[0] == "zeroone" else [])]
            for name, run in RUNS.items()}  # 0/1 Adam with kappa 1: v's whole steps 1, 2, 4, 8, .. (kappa 16: 1-16)
    # under ZeRO-1 the 1-bit rounds are followed by the parameters' all-gather, uncompressed
    runs.update({"uncompressed, ZeRO-1": [*shape, "--zero", "1"],
                 "1-bit Adam, ZeRO-1": [*shape, *flags(RUNS["1-bit Adam"], 2), "--zero", "1"]})
    for name, steps in _on_two_nodes(args, "c", "10.233.9", 1, runs):
        results[name] = (statistics.median(r["step_time_s"] for r in steps),
                         statistics.median(dp_bytes(r) for r in steps))  # 0/1 Adam: its compressed steps'
    base = results["uncompressed"][0]
    print(f"| run ({args.rate} link, small, 2 x 2 x 64 tokens a step) | median step | speed-up | "
          f"dp bytes per step |")
    print("|---|---|---|---|")
    for name, (seconds, nbytes) in results.items():
        print(f"| {name} | {seconds:.3f} s | {base / seconds:.2f}x | {nbytes / 1e6:.2f} MB |")


HPZ_RUNS = {"ZeRO-3": [], "ZeRO-3 + hpZ (K=2)": ["--hpz-partition-size", "2"]}


def hpz(args) -> None:
    """Two nodes of two ranks (ranks 0, 1 on the first: hpZ's node groups are the nodes): the median
    step time and the bytes a rank sends over the dp group (crossing the link) and over the node group."""
    results = {}
    for name, steps in _on_two_nodes(args, "h", "10.233.10", 2, {
            name: ["--micro-batch", "2", "--global-batch", "8", "--zero", "3", *extra] for name, extra in HPZ_RUNS.items()}):

        def sent(group: str) -> float:
            return statistics.median(sum(b for op, b in r["comm_bytes_by_op"].items() if op.endswith(f"/{group}"))
                                     for r in steps)
        results[name] = (statistics.median(r["step_time_s"] for r in steps), sent("dp"), sent("dp_node"))
    base = results["ZeRO-3"][0]
    print(f"| run ({args.rate} link between 2 nodes of 2 ranks, small, fp32, 4 x 2 x 64 tokens a step) | median step "
          f"| speed-up | dp bytes per step (rank 0) | node-group bytes |")
    print("|---|---|---|---|---|")
    for name, (seconds, dp, node) in results.items():
        print(f"| {name} | {seconds:.3f} s | {base / seconds:.2f}x | {dp / 1e6:.1f} MB | {node / 1e6:.1f} MB |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["loss", "link", "hpz"])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--work", default="/tmp/strata-compression")
    parser.add_argument("--rate", help="link and hpz: the link's rate, for tc (default 100mbit)")
    parser.add_argument("--out", help="loss: the plot (default docs/img/compression_val_loss.png)")
    parser.add_argument("--runs", type=lambda text: text.split(","),
                        help=f"loss: which runs, comma-separated, of: {', '.join(RUNS)} (default all)")
    parser.add_argument("--dtype", choices=sorted({dtype for dtype, _, _ in BASELINES}), help="loss: default fp32")
    parser.add_argument("--lr", type=float, help="loss: the peak learning rate, cosine to a tenth of it (default 6e-4)")
    parser.add_argument("--onebit-warm-up", type=int,
                        help="loss: 1-bit Adam's AdamW warm-up (--compress-after), in per cent of --steps (default 25)")
    parser.add_argument("--micro-batch", type=int,
                        help="loss: a rank's sequences of 256 tokens a step, the global batch twice it (default 4)")
    parser.add_argument("--reuse", action="store_true", default=None,
                        help="loss: keep a run's metrics in --work when they reach --steps (plot and table only)")
    args = parser.parse_args()
    # each measurement's own flags: given to another, they would be ignored, so they are refused
    defaults = {"loss": {"out": "docs/img/compression_val_loss.png", "runs": list(RUNS), "dtype": "fp32", "lr": 6e-4,
                         "onebit_warm_up": 25, "micro_batch": 4, "reuse": False},
                "link": {"rate": "100mbit"}, "hpz": {"rate": "100mbit"}}
    for name in {key for own in defaults.values() for key in own} - set(defaults[args.what]):
        if getattr(args, name) is not None:
            parser.error(f"--{name.replace('_', '-')}: not a flag of {args.what} (it acts only with "
                         f"{' and '.join(what for what, own in defaults.items() if name in own)})")
    for name, value in defaults[args.what].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    os.makedirs(args.work, exist_ok=True)
    if args.what == "loss":
        unknown = [name for name in args.runs if name not in RUNS]
        if unknown:
            parser.error(f"--runs {','.join(unknown)}: valid: {', '.join(RUNS)}")
        args.steps = args.steps or 300
        for flag, value, valid in (("--onebit-warm-up", args.onebit_warm_up, 1 <= args.onebit_warm_up <= 99),
                                   ("--micro-batch", args.micro_batch, args.micro_batch >= 1),
                                   ("--lr", args.lr, args.lr > 0)):
            if not valid:
                parser.error(f"{flag} {value}: must be {'1 to 99' if flag == '--onebit-warm-up' else 'positive'}")
        if "uncompressed" not in args.runs and (args.dtype, args.micro_batch, args.lr) not in BASELINES:
            parser.error(f"--runs without uncompressed: no uncompressed loss is known for --dtype {args.dtype} "
                         f"--micro-batch {args.micro_batch} --lr {args.lr:g}; known: "
                         f"{', '.join(f'{d} {b} {lr:g}' for d, b, lr in BASELINES)}")
        loss(args)
    elif args.what == "hpz":
        args.steps = args.steps or 8
        hpz(args)
    else:
        args.steps = args.steps or 12
        link(args)


if __name__ == "__main__":
    main()
