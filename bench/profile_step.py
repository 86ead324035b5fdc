"""Where one process's training step spends its time: torch.profiler over `strata train`'s steps
and over the plain loop of transformers' LlamaForCausalLM of the same shape (bench/hf_peers.py's
`hf`), the top operators by self CPU time side by side. Run it against two checkouts to see what a
change moved (the strata code is whatever is on PYTHONPATH):

  PYTHONPATH=. python bench/profile_step.py --dtype bf16
  PYTHONPATH=/path/to/older/checkout python bench/profile_step.py --dtype bf16 --skip-hf

The first step (allocation, lazy initialisation) is left out of both: the profiler starts at the
second step and records --steps more."""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile, schedule

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def strata_profile(args) -> profile:
    from strata.config import train_config
    from strata.train import trainer

    prof = profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=0, active=args.steps))
    train_step = trainer.train_step  # one call per optimizer step: the profiler's step boundary

    def stepped(*a, **k):
        out = train_step(*a, **k)
        prof.step()
        return out
    trainer.train_step = stepped
    cfg = train_config(model=args.model, seq_len=args.seq_len, micro_batch=args.micro_batch,
                      global_batch=args.micro_batch, steps=args.steps + 1, dtype=args.dtype, progress=False,
                      eval_batches=1, peak_flops=1e12, lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1,
                      grad_clip=1.0)
    with prof:
        trainer.train(cfg)
    trainer.train_step = train_step
    return prof


def hf_profile(args) -> profile:
    from hf_peers import adamw, autocast, llama

    model = llama(args.model)
    opt = adamw(model.parameters())
    batch = torch.randint(0, model.config.vocab_size, (args.micro_batch, args.seq_len))
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=0, active=args.steps)) as prof:
        for _ in range(args.steps + 1):
            with autocast(args.dtype):
                loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    return prof


def top_ops(prof: profile, rows: int) -> list[tuple[str, float, int]]:
    """(operator, self CPU ms per step, calls per step), the most expensive first."""
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
    return [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in events]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sides = [("strata", strata_profile(args))] + ([] if args.skip_hf else [("transformers", hf_profile(args))])
    for name, prof in sides:
        total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3 / args.steps
        print(f"\n{name}: {total:.0f} ms of self CPU time per step ({args.model}, {args.dtype}, "
              f"{args.micro_batch} x {args.seq_len} tokens)\n")
        print("| operator | ms per step | calls per step |\n|---|---|---|")
        for key, ms, count in top_ops(prof, args.rows):
            print(f"| `{key}` | {ms / args.steps:.1f} | {count / args.steps:g} |")


if __name__ == "__main__":
    main()
