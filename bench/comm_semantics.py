"""What NCCL's rules on gloo cost: each strata layout under `--comm-semantics nccl` (one thread per
process group running its operations in issue order, sends that wait for their receive, device
checks, a watchdog) against the same run under gloo's own semantics, in alternating fresh jobs.

  python bench/comm_semantics.py --nproc 2 --micro-batches 4 [--rounds 2] [--steps 6]
  python bench/comm_semantics.py --nproc 4 --micro-batches 8
"""

from jobs import compare, parser

LAYOUTS = [("DP (ZeRO-0)", "z0"), ("ZeRO-3", "z3"), ("TP + SP", "tp-sp"), ("PP 1F1B", "pp-1f1b"),
           ("PP interleaved (v = 2)", "pp-interleaved")]
PAIRS = [(label, f"strata-{impl}-nccl", f"strata-{impl}") for label, impl in LAYOUTS]

if __name__ == "__main__":
    compare(PAIRS, parser(__doc__.split("\n")[0]).parse_args())
