"""strata's data parallelism and ZeRO against torch DDP, DeepSpeed ZeRO-0..3 and FSDP2, 2 ranks.

  python bench/data_parallel.py [--rounds 2] [--steps 6]   (DeepSpeed: DS_BUILD_OPS=0 pip install deepspeed)
"""

import importlib.util

from jobs import compare, parser

PAIRS = [("ZeRO-0", "strata-z0", "ddp"), ("ZeRO-0", "strata-z0", "deepspeed-z0"),
         ("ZeRO-1", "strata-z1", "deepspeed-z1"), ("ZeRO-2", "strata-z2", "deepspeed-z2"),
         ("ZeRO-3", "strata-z3", "deepspeed-z3"), ("ZeRO-3", "strata-z3", "fsdp2")]

if __name__ == "__main__":
    args = parser(__doc__.split("\n")[0]).parse_args()
    has_deepspeed = importlib.util.find_spec("deepspeed") is not None
    compare([p for p in PAIRS if has_deepspeed or not p[2].startswith("deepspeed")], args)
