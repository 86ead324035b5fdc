"""Does a process keep more of its share of the cores when it holds fewer weights? N processes at
once each run the forward and backward of `small` (micro-batch 4, sequence 128) cut to B blocks,
against one process alone: the share kept is (one alone / each of N) / (cores / N).

A pipeline rank of pp4 holds a quarter of the blocks; calibration measures the share with every
process running the whole model. If the share grew as the weights shrank (a smaller working set in
the caches), pipelines on shared cores would run faster than the planner prices them.

  python bench/core_share_by_blocks.py [--blocks 6 2 1] [--procs 4] [--seconds 6] [--repeats 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import statistics
import time


def _run(blocks: int, seconds: float, barrier, results) -> None:
    import torch

    from strata.model.presets import get_preset
    from strata.model.transformer import build_model
    torch.set_num_threads(1)
    cfg = dataclasses.replace(get_preset("small"), n_layers=blocks)
    net = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (4, 128))
    net(tokens, tokens).backward()  # warm-up
    barrier.wait()
    times, started = [], time.perf_counter()
    while time.perf_counter() - started < seconds:
        t = time.perf_counter()
        net(tokens, tokens).backward()
        times.append(time.perf_counter() - t)
    results.put(statistics.median(times))


def step_seconds(procs: int, blocks: int, seconds: float) -> float:
    """The mean over `procs` processes running at once of each one's median step."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_run, args=(blocks, seconds, barrier, results)) for _ in range(procs)]
    for w in workers:
        w.start()
    times = [results.get() for _ in workers]
    for w in workers:
        w.join()
    return statistics.mean(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[6, 2, 1])
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    even = min(1.0, len(os.sched_getaffinity(0)) / args.procs)
    for _ in range(args.repeats):
        for blocks in args.blocks:
            alone, together = step_seconds(1, blocks, args.seconds), step_seconds(args.procs, blocks, args.seconds)
            print(f"{blocks} blocks: one process {alone * 1e3:.1f} ms, each of {args.procs} {together * 1e3:.1f} ms: "
                  f"kept {alone / together / even:.2f} of an even split", flush=True)


if __name__ == "__main__":
    main()
