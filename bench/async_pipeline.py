"""Idle fraction per rank of the asynchronous schedules against 1F1B, with stages whose cost is a
sleep (forward 20 ms, backward 40 ms by default): p ranks, m micro-batches per step.

The stages are the executor's own (strata/parallel/pipeline/executor.py) with a chunk that sleeps
instead of computing, so the numbers are the schedule's and the executor's, not the CPU's: 1F1B
runs `PipelineExecutor.step` (a flush every step), 2BW and PipeDream `PipelineExecutor.segment`
(no flush) with a weight version per step, each rank updating its one parameter after its segment.
The steady state leaves out the first step (the fill) and the last (the drain).

  python bench/async_pipeline.py [--pp 4] [--micro-batches 8] [--steps 8] [--forward-ms 20] [--backward-ms 40]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from strata.distributed.mesh import ParallelDims, pipeline_links  # noqa: E402
from strata.parallel.pipeline.executor import PipelineExecutor  # noqa: E402
from strata.parallel.pipeline.versions import WeightVersions  # noqa: E402
from strata.rules.pipeline_cut import PipelineLayout  # noqa: E402
from strata.rules.schedules import SCHEDULES  # noqa: E402

from distributed import run_on_ranks  # noqa: E402

WIDTH = 8  # the activation passed between stages: (1, 1, WIDTH)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, grad.sum().reshape(1), None, None


class SleepStage(nn.Module):
    def __init__(self, last: bool, forward_s: float, backward_s: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.last, self.forward_s, self.backward_s = last, forward_s, backward_s

    def forward(self, x, targets=None):
        y = _Sleep.apply(x.float(), self.weight, self.forward_s, self.backward_s)
        return y.mean() if self.last else y


def _rank(schedule: str, p: int, m: int, steps: int, forward_s: float, backward_s: float) -> list[float]:
    import torch.distributed as dist
    rank = dist.get_rank()
    stage = SleepStage(rank == p - 1, forward_s, backward_s)
    spec = SCHEDULES[schedule]
    versions = WeightVersions(list(stage.named_parameters()), spec.delay(p, rank)) if spec.asynchronous else None
    links = pipeline_links(ParallelDims(pp=p), rank, wraps=False, timeout_s=300)
    executor = PipelineExecutor({rank: stage}, PipelineLayout(p, 1, (1,) * p), schedule, dist.group.WORLD, links,
                                (1, 1, WIDTH), torch.float32, torch.device("cpu"), versions=versions)
    optimizer = torch.optim.SGD([stage.weight.data if versions else stage.weight], lr=0.0)
    batch = (torch.ones(1, 1, WIDTH), torch.zeros(1, 1, dtype=torch.long))
    idle = []
    for step in range(steps):
        if versions is None:
            executor.step([batch] * m)
        else:
            executor.segment(lambda k: batch, m, step, fill=step == 0, stop=steps * m)
        optimizer.param_groups[0]["params"][0].grad = stage.weight.grad
        optimizer.step()
        if versions is not None:
            versions.updated()
        stage.weight.grad = None
        idle.append(executor.idle_fraction)
    return idle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--forward-ms", type=float, default=20)
    parser.add_argument("--backward-ms", type=float, default=40)
    args = parser.parse_args()
    p, m = args.pp, args.micro_batches
    rows = {}
    for schedule in ("1f1b", "2bw", "pipedream"):
        per_step = 1 if SCHEDULES[schedule].update_per_micro_batch else m  # PipeDream: a step is a micro-batch
        steps = args.steps * (m // per_step)  # the same micro-batches in all
        idle = run_on_ranks(_rank, p, schedule, p, per_step, steps, args.forward_ms / 1e3, args.backward_ms / 1e3,
                            timeout=600)
        steady = [sum(r[1:-1]) / len(r[1:-1]) for r in idle]  # without the fill and the drain
        rows[schedule] = steady
        print(f"{schedule:10s} steady-state idle fraction per rank: " + " ".join(f"{x:.3f}" for x in steady)
              + f"   (formula for 1F1B: (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.3f})", flush=True)
    print(json.dumps({"pp": p, "micro_batches": m, "forward_ms": args.forward_ms, "backward_ms": args.backward_ms,
                      "idle": rows}))


if __name__ == "__main__":
    main()
