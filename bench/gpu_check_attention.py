"""bench/gpu_check.py's attention timings (part `step`, issue 53 item 1): forward + backward, median
of 5 after a warm-up, on one set of tokens.

  ring      context parallelism's blocks (cp 4: every rank's two chunks against every rank's K/V,
            merged by log-sum-exp; strata/parallel/ring_attention.blocks_in_one_process) by the
            device's fused kernels, and by the matrix products over tiles the GPU used before,
            against one SDPA call over the whole sequence
  window    sliding-window attention in one process by blocks (strata/model/attention_blocks.py)
            against SDPA with the (S, S) mask: time, peak memory (CUDA's max_memory_allocated; the
            CPU: LiveBytes) and the largest relative difference of the output and gradients

Full: bf16, 32 query heads of 128 over 8 KV heads, 8,192 tokens, window 1,024 (Mistral's layer at
a shorter context). Quick mode (the CPU): fp32, 4 heads of 16 over 2, 256 tokens, window 64."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from gpu_check_correctness import median_ms

from strata.memory.live_bytes import LiveBytes
from strata.model import attention_blocks as ab
from strata.model.layers import attention_bias
from strata.parallel.ring_attention import blocks_in_one_process

if TYPE_CHECKING:
    from gpu_check_parts import Check

FULL = {"dtype": torch.bfloat16, "heads": 32, "kv_heads": 8, "seq": 8192, "d": 128, "window": 1024}
QUICK = {"dtype": torch.float32, "heads": 4, "kv_heads": 2, "seq": 256, "d": 16, "window": 64}


def attention(check: Check, quick: bool) -> dict:
    shape = QUICK if quick else FULL
    torch.manual_seed(0)
    device, dtype = check.device, shape["dtype"]
    q = torch.randn(1, shape["heads"], shape["seq"], shape["d"], dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(1, shape["kv_heads"], shape["seq"], shape["d"], dtype=dtype, device=device,
                        requires_grad=True) for _ in range(2))
    grad = torch.randn_like(q)
    return {"shape": {**shape, "dtype": str(dtype).removeprefix("torch.")},
            "ring": _ring(device, q, k, v, grad), "window": _window(device, q, k, v, grad, shape["window"])}


def _ring(device, q, k, v, grad) -> dict:
    def sdpa():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(grad)

    detached = [t.detach() for t in (q, k, v)]
    kernel = ab.kernel_for(detached[0])
    times = {"sdpa_ms": median_ms(device, sdpa),
             "blocks_ms": median_ms(device, lambda: blocks_in_one_process(*detached, grad, 4, None, None)),
             "tiles_ms": median_ms(device, lambda: blocks_in_one_process(*detached, grad, 4, None, None,
                                                                         ab.Blockwise))}
    return {"kernel": kernel.__name__, **times, "blocks_over_sdpa": times["blocks_ms"] / times["sdpa_ms"],
            "tiles_over_blocks": times["tiles_ms"] / times["blocks_ms"]}


def _window(device, q, k, v, grad, window: int) -> dict:
    mask = attention_bias(q.shape[2], 0, None, None, q.dtype, device, window)
    runs = {"sdpa_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
            "blocks": lambda: ab.causal_attention(q, k, v, ab.CausalMask(window, None))}
    found = {}
    for name, run in runs.items():
        for t in (q, k, v):
            t.grad = None
        out = run()
        out.backward(grad)
        found[name] = [out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()]
    difference = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                     for a, b in zip(found["blocks"], found["sdpa_mask"]))
    result = {"window": window, "relative_difference": difference}
    for name, run in runs.items():
        result[f"{name}_ms"] = median_ms(device, lambda run=run: run().backward(grad))
        result[f"{name}_peak_bytes"] = peak_bytes(device, lambda run=run: run().backward(grad))
    result["passed"] = difference <= (3e-2 if q.dtype == torch.bfloat16 else 1e-5)
    return result


def peak_bytes(device: torch.device, step) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    with LiveBytes() as counted:
        step()
    return counted.peak
