"""`strata train` against transformers' LlamaForCausalLM of the same shape under the engines a user
would pick instead (bench/hf_peers.py: a plain loop, torch DDP, FSDP2, DeepSpeed ZeRO-1/2/3, DTensor
tensor parallelism), in fp32 and bf16; and strata's --compile against its eager run.

Every job is a fresh process group (the strata command with --nproc, or torchrun of the peer), one
thread per rank. Within a round the pairs run back to back, strata and peer alternating which goes
first from round to round, so machine noise falls on both; a job's step time is the median of its
steps after the first. The table gives each round's ratio strata / peer and their median.

  python bench/vs_hf.py [--rounds 3] [--steps 6] [--dtypes fp32 bf16] [--only one-process dp2 ...]
  (DeepSpeed: DS_BUILD_OPS=0 pip install deepspeed; its rows are left out without it)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# name -> (strata's flags, its ranks, the peer: an impl of hf_peers.py, or strata flags for --compile)
PAIRS = {
    "one-process": ([], 1, "hf"),
    "dp2": (["--dp", "2"], 2, "ddp"),
    "zero1": (["--dp", "2", "--zero", "1"], 2, "deepspeed-z1"),
    "zero2": (["--dp", "2", "--zero", "2"], 2, "deepspeed-z2"),
    "zero3-deepspeed": (["--dp", "2", "--zero", "3"], 2, "deepspeed-z3"),
    "zero3-fsdp2": (["--dp", "2", "--zero", "3"], 2, "fsdp2"),
    "tp2": (["--tp", "2"], 2, "dtensor-tp"),
    "compile-one-process": (["--compile"], 1, []),
    "compile-dp2": (["--dp", "2", "--compile"], 2, ["--dp", "2"]),
}
# In bf16, strata moves what the peer moves, by its flags: DeepSpeed's bf16 mode computes with bf16
# weights (gathered in bf16) and reduces bf16 gradients; FSDP2's policy (hf_peers.py) gathers bf16
# and reduces fp32; DDP reduces the fp32 gradients of its fp32 parameters, as strata does by default.
BF16_TRANSFERS = {
    "zero1": ["--reduce-dtype", "bf16", "--gather-dtype", "bf16"],
    "zero2": ["--reduce-dtype", "bf16", "--gather-dtype", "bf16"],
    "zero3-deepspeed": ["--reduce-dtype", "bf16", "--gather-dtype", "bf16"],
    "zero3-fsdp2": ["--gather-dtype", "bf16"],
}
# Inductor's on-disk caches off: every --compile job compiles from cold, and reports that time
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false",
       "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}


class JobFailed(Exception):
    pass


def strata_job(flags: list[str], nproc: int, dtype: str, args, out: str) -> dict:
    ranks_reading = 1 if "--tp" in flags else nproc  # tensor-parallel ranks read one batch
    cmd = [sys.executable, "-m", "strata", "train", "--model", args.model, "--dtype", dtype, "--steps", str(args.steps),
           "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
           "--global-batch", str(args.micro_batch * ranks_reading), "--lr", "1e-3", "--beta1", "0.9", "--beta2", "0.95",
           "--weight-decay", "0.1", "--grad-clip", "1.0", "--eval-batches", "1", "--peak-flops", "1e12",
           "--no-progress", "--metrics", out, *(["--nproc", str(nproc)] if nproc > 1 else []), *flags]
    result = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=1800)
    if result.returncode:
        raise JobFailed(f"strata {' '.join(flags)} failed:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in open(out)]
    steps = [r["step_time_s"] for r in records if r["kind"] == "train"]
    compile_s = next((r["compile_s"] for r in records if r.get("kind") == "compile"), None)
    return {"step_times": steps, "compile_s": compile_s}


def peer_job(impl: str, nproc: int, dtype: str, args, out: str) -> dict:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] \
        if nproc > 1 else [sys.executable]
    cmd = [*launcher, os.path.join(HERE, "hf_peers.py"), "--impl", impl, "--dtype", dtype, "--model", args.model,
           "--steps", str(args.steps), "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
           "--out", out]
    result = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=1800)
    if result.returncode:
        raise JobFailed(f"{impl} failed:\n{result.stderr[-3000:]}")
    return json.load(open(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="steps per job; the first is left out")
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--only", nargs="+", choices=list(PAIRS), default=list(PAIRS))
    args = parser.parse_args()
    has_deepspeed = importlib.util.find_spec("deepspeed") is not None
    pairs = [p for p in args.only if has_deepspeed or "deepspeed" not in str(PAIRS[p][2])]
    print(f"{args.model} preset, {args.micro_batch} x {args.seq_len} tokens per rank per step, 1 thread per rank, "
          f"gloo; {args.rounds} rounds of {args.steps} steps per job (first left out), strata and peer alternating\n")
    print("| layout | dtype | peer | strata step (s) | peer step (s) | strata / peer per round | median |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in pairs:
            for dtype in args.dtypes:
                flags, nproc, peer = PAIRS[name]
                flags = flags + (BF16_TRANSFERS.get(name, []) if dtype == "bf16" else [])
                ours, theirs, compile_times = [], [], []
                label = f"strata {' '.join(peer)}".strip() if isinstance(peer, list) else peer
                try:
                    for round_ in range(args.rounds):
                        jobs = [("strata", lambda: strata_job(flags, nproc, dtype, args, f"{tmp}/a.jsonl")),
                                ("peer", lambda: strata_job(peer, nproc, dtype, args, f"{tmp}/b.jsonl")
                                 if isinstance(peer, list) else peer_job(peer, nproc, dtype, args, f"{tmp}/b.json"))]
                        for side, job in (jobs if round_ % 2 == 0 else jobs[::-1]):
                            result = job()
                            (ours if side == "strata" else theirs).append(statistics.median(result["step_times"][1:]))
                            if side == "strata" and result.get("compile_s") is not None:
                                compile_times.append(result["compile_s"])
                except JobFailed as failed:  # one broken job costs its row, not the table
                    print(f"{failed}", file=sys.stderr)
                    print(f"| {name} | {dtype} | {label} | failed: {str(failed).splitlines()[0]} | | | |", flush=True)
                    continue
                ratios = [a / b for a, b in zip(ours, theirs)]
                note = f" (compile {statistics.median(compile_times):.1f} s)" if compile_times else ""
                note += f" `{' '.join(BF16_TRANSFERS[name])}`" if dtype == "bf16" and name in BF16_TRANSFERS else ""
                print(f"| {name}{note} | {dtype} | {label} | {statistics.median(ours):.3f} | "
                      f"{statistics.median(theirs):.3f} | {', '.join(f'{r:.3f}' for r in ratios)} | "
                      f"**{statistics.median(ratios):.3f}** |", flush=True)


if __name__ == "__main__":
    main()
