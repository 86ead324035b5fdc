"""Checkpoint save and load, side by side in one process with the peers on the same state: the
`small` preset after one AdamW step (weights + Adam's two moments, 3 x 4 bytes per parameter).

- strata: `save_checkpoint` (snapshot, safetensors, sha256, manifest, atomic rename) blocking, and
  with --async-save the time the training thread is held (the snapshot) and the time to done;
  `load_checkpoint` back into the same layout.
- torch.distributed.checkpoint (DCP) `save` / `load` of the model and optimizer state dicts.
- `torch.save` / `torch.load` of the same two state dicts (no checksums, no layout metadata).
Runs alternate (strata, DCP, torch.save, ...) so machine noise hits all alike; medians.

  python bench/checkpoint.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

from strata.config import train_config
from strata.train.run_state import load_checkpoint, save_checkpoint
from strata.train.trainer import setup, train_step


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="strata-bench-ckpt-")
    cfg = train_config(model="small", seq_len=64, micro_batch=2, steps=1, progress=False, peak_flops=1e12,
                      save=os.path.join(root, "strata"))
    run = setup(cfg)
    train_step(run, 0)
    state = lambda: {"model": run.model.state_dict(), "optim": run.optimizer.state_dict()}  # noqa: E731
    times = {k: [] for k in ("strata save", "strata async: held", "strata async: done", "strata load",
                             "DCP save", "DCP load", "torch.save", "torch.load")}
    for r in range(args.rounds):
        step = r + 1
        times["strata save"].append(_timed(lambda: save_checkpoint(run, step)))
        run.checkpointer.background = True
        started = time.perf_counter()
        times["strata async: held"].append(_timed(lambda: save_checkpoint(run, 1000 + step)))
        run.checkpointer.wait()
        times["strata async: done"].append(time.perf_counter() - started)
        run.checkpointer.background = False
        times["strata load"].append(_timed(lambda: load_checkpoint(run, os.path.join(root, "strata"), resume=True)))
        dcp_dir = os.path.join(root, f"dcp_{step}")
        times["DCP save"].append(_timed(lambda: dcp.save(state(), checkpoint_id=dcp_dir, no_dist=True)))
        target = state()
        times["DCP load"].append(_timed(lambda: dcp.load(target, checkpoint_id=dcp_dir, no_dist=True)))
        pt = os.path.join(root, f"state_{step}.pt")
        times["torch.save"].append(_timed(lambda: torch.save(state(), pt)))
        times["torch.load"].append(_timed(lambda: torch.load(pt, weights_only=True)))
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(root, "strata", "step_000001"))
               for f in fs)
    print(f"small preset ({run.model_cfg.num_params():,} parameters), one process, {args.rounds} alternating rounds, "
          f"median; a strata checkpoint is {size / 2**20:.1f} MiB\n")
    print("| operation | seconds | MiB/s |")
    print("|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.3f} | {size / 2**20 / median:,.0f} |")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
