"""Sliding-window and ALiBi attention by blocks (strata/model/attention_blocks.py) against SDPA with
the whole (S, S) mask, on this machine's device: forward + backward, median of 5, and the peak of
the bytes allocated (CUDA's counter, or LiveBytes on the CPU), fp32 on the CPU (bf16 on CUDA), 8
query heads of 64 over 2 KV heads, one sequence.

  PYTHONPATH=. python bench/attention_blocks.py [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check_attention import peak_bytes  # noqa: E402
from gpu_check_correctness import median_ms  # noqa: E402

from strata.model import attention_blocks as ab  # noqa: E402
from strata.model.layers import alibi_slopes, attention_bias  # noqa: E402

CASES = [(512, 128, False), (2048, 512, False), (1024, None, True), (2048, None, True)]  # tokens, window, ALiBi


def compare(device: torch.device, seq: int, window: int | None, alibi: bool) -> dict:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(1, 8, seq, 64, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(1, 2, seq, 64, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    slopes = alibi_slopes(8) if alibi else None
    grad = torch.randn_like(q)

    def sdpa():
        mask = attention_bias(seq, 0, None, slopes, dtype, device, window)
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).backward(grad)

    def blocks():
        ab.causal_attention(q, k, v, ab.CausalMask(window, slopes)).backward(grad)

    found = {"tokens": seq, "window": window, "alibi": alibi, "dtype": str(dtype).removeprefix("torch.")}
    for name, run in (("sdpa_mask", sdpa), ("blocks", blocks)):
        found[f"{name}_ms"] = round(median_ms(device, run), 2)
        found[f"{name}_peak_mib"] = round(peak_bytes(device, run) / 2**20, 2)
    found["sdpa_over_blocks"] = round(found["sdpa_mask_ms"] / found["blocks_ms"], 2)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(parser.parse_args().device)
    for case in CASES:
        print(json.dumps(compare(device, *case)))


if __name__ == "__main__":
    main()
