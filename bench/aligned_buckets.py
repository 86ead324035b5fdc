"""The padding of ZeRO-0/1/2's aligned flat buffers (strata/rules/buckets.py: each parameter's start
on 64 elements, each bucket a multiple of 128 and of dp shards of 64) against the packed layout
(padded to a multiple of dp only): elements of padding over each preset's parameters, back to front
in 25 MB buckets of fp32 masters, on the meta device.

  PYTHONPATH=. python bench/aligned_buckets.py [tiny llama-1b gpt2-124m]
"""

from __future__ import annotations

import json
import sys

import torch

from strata.model.presets import get_preset
from strata.model.transformer import Transformer
from strata.rules import buckets as rule
from strata.rules.constants import BUCKET_MB

DP_SIZES = (1, 2, 3, 4, 8, 64)


def padding(name: str) -> dict:
    with torch.device("meta"):
        model = Transformer(get_preset(name))
    sizes = [p.numel() for p in reversed(list(model.parameters()))]
    total, elements = sum(sizes), rule.bucket_elements(BUCKET_MB, 4)
    rows = {}
    for dp in DP_SIZES:
        packed = sum(p.size for p in rule.plan_buckets(sizes, elements, dp)) - total
        plans = rule.plan_buckets(sizes, elements, dp, aligned=True)
        aligned = sum(p.size for p in plans) - total
        rows[dp] = {"buckets": len(plans), "packed": packed, "aligned": aligned, "aligned_fraction": aligned / total}
    return {"model": name, "parameters": total, "tensors": len(sizes), "by_dp": rows}


if __name__ == "__main__":
    for name in sys.argv[1:] or ["tiny", "llama-1b", "gpt2-124m"]:
        print(json.dumps(padding(name)))
