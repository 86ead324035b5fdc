"""strata's tensor parallelism against torch DTensor tensor parallelism (ColwiseParallel /
RowwiseParallel, Megatron placement; SequenceParallel as torchtitan plans it) on the same model,
2 ranks, same batch on both ranks.

  python bench/tensor_parallel.py [--rounds 2] [--steps 6]
"""

from jobs import compare, parser

PAIRS = [("TP 2", "strata-tp", "dtensor-tp"), ("TP 2 + sequence parallel", "strata-tp-sp", "dtensor-tp-sp")]

if __name__ == "__main__":
    compare(PAIRS, parser(__doc__.split("\n")[0]).parse_args())
