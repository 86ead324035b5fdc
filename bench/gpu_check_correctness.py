"""bench/gpu_check.py's correctness part: the device against the CPU (training in fp64 and fp32,
ZeRO-Infinity's offload against the same run kept on the device, a mixture of experts, greedy
generation, ring attention's blocks against one attention, the experts' grouped product against
their loop), each with the tolerance strata's own equivalence tests use between layouts. Quick mode
runs it on the CPU against itself."""

from __future__ import annotations

import statistics
import time
import warnings
from typing import TYPE_CHECKING

import torch

from strata.config import TrainConfig, train_config, with_settings
from strata.distributed.host_syncs import HostSyncs
from strata.infer.generate import generate
from strata.model.grouped_experts import experts_path, loop_experts
from strata.model.layers import attention_bias
from strata.model.moe import Experts
from strata.model.presets import get_preset
from strata.model.transformer import build_model
from strata.parallel.ring_attention import blocks_in_one_process
from strata.train.trainer import train

if TYPE_CHECKING:  # gpu_check_parts imports this module
    from gpu_check_parts import Check

# Correctness: strata's equivalence tests use these tolerances between layouts; a device change
# adds different kernels (reduction orders), not different mathematics.
TOLERANCE = {"fp64": 1e-9, "fp32": 1e-4}
CORRECTNESS_STEPS = 6
GREEDY_PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11]]  # unequal lengths: left padding is exercised
GREEDY_TOKENS = 12


# --- correctness: the device against the CPU ----------------------------------------------------------
def tiny_config(dtype: str, device: str, model: str = "tiny") -> TrainConfig:
    return train_config(model=model, dtype=dtype, steps=CORRECTNESS_STEPS, micro_batch=4, device=device,
                       eval_batches=1, progress=False, peak_flops=1e12, seed=0)


def max_state_difference(a: dict, b: dict) -> float:
    return max((a[k].detach().cpu().double() - b[k].detach().cpu().double()).abs().max().item() for k in a)


def training_matches_cpu(check: Check, dtype: str, model: str = "tiny") -> dict:
    reference = train(tiny_config(dtype, "cpu", model), keep_state=True)
    on_device = train(tiny_config(dtype, check.device.type, model), keep_state=True)
    loss_diff = max(abs(a - b) for a, b in zip(reference["losses"], on_device["losses"]))
    param_diff = max_state_difference(reference["state"], on_device["state"])
    tolerance = TOLERANCE[dtype]
    return {"tolerance": tolerance, "max_loss_diff": loss_diff, "max_param_diff": param_diff,
            "losses_cpu": reference["losses"], "losses_device": on_device["losses"],
            "passed": len(reference["losses"]) == CORRECTNESS_STEPS == len(on_device["losses"])
            and loss_diff <= tolerance and param_diff <= tolerance}


def offload_matches_memory(check: Check) -> dict:
    """ZeRO-Infinity's GPU paths (shards and Adam's moments in pinned host memory, checkpointed
    activations there too) against the same run kept on the device: bit for bit."""
    def run(**offload):
        cfg = with_settings(tiny_config("fp32", check.device.type), checkpointing="full", **offload)
        return train(cfg, keep_state=True)
    reference = run()
    offloaded = run(offload_params="cpu", offload="cpu", offload_activations="cpu")
    param_diff = max_state_difference(reference["state"], offloaded["state"])
    return {"tolerance": 0.0, "max_loss_diff": max(abs(a - b) for a, b in zip(reference["losses"], offloaded["losses"])),
            "max_param_diff": param_diff, "losses_cpu": reference["losses"], "losses_device": offloaded["losses"],
            "offload": offloaded["records"][-1].get("offload"),
            "passed": reference["losses"] == offloaded["losses"] and param_diff == 0.0}


def greedy_tokens(device: torch.device | str, dtype: torch.dtype) -> list[list[int]]:
    model = build_model(get_preset("tiny"), device, dtype, seed=0)
    steps = [ids.tolist() for ids in generate(model, GREEDY_PROMPTS, GREEDY_TOKENS)]
    return [list(row) for row in zip(*steps)]


def generation_matches_cpu(check: Check, dtype: torch.dtype) -> dict:
    reference, on_device = greedy_tokens("cpu", dtype), greedy_tokens(check.device, dtype)
    return {"tokens_cpu": reference, "tokens_device": on_device, "passed": reference == on_device}


def ring_blocks_match_attention(check: Check, dtype: torch.dtype, window: int | None) -> dict:
    """Context parallelism's ring on the device: cp 4's blocks, computed by the kernel the ring uses
    there (matrix products over tiles of queries on a GPU), merged by log-sum-exp, against one
    attention over the whole sequence on the device (the output and the gradients of q, k and v,
    relative to the largest value); 8 query heads of 64 over 2 KV heads, 512 tokens."""
    torch.manual_seed(0)
    q = torch.randn(1, 8, 512, 64, dtype=dtype, device=check.device, requires_grad=True)
    k, v = (torch.randn(1, 2, 512, 64, dtype=dtype, device=check.device, requires_grad=True) for _ in range(2))
    mask = attention_bias(512, 0, None, None, dtype, check.device, window)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                                 enable_gqa=True)
    grad = torch.randn_like(reference)
    reference.backward(grad)
    ours = blocks_in_one_process(q.detach(), k.detach(), v.detach(), grad, 4, window, None)
    errors = {name: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
              for name, a, b in zip(("out", "dq", "dk", "dv"), ours, (reference.detach(), q.grad, k.grad, v.grad))}
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4  # bf16: a few of its 2^-7 steps
    return {"window": window, "relative_errors": errors, "tolerance": tolerance,
            "passed": max(errors.values()) <= tolerance}


# The experts' check: uneven rows per expert, two experts without rows, counts not multiples of 8.
EXPERT_ROWS = [0, 37, 5, 0, 130, 1, 77, 13]
EXPERT_TIMING = {"cuda": (64, 1024, 1024, 16384), "cpu": (8, 64, 128, 256)}  # experts, d_model, d_ff, rows


def _experts_on(device: torch.device, n: int, d_model: int, d_ff: int) -> Experts:
    experts = Experts(n, d_model, d_ff).to(device, torch.bfloat16)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.05)
    return experts


def _experts_step(experts: Experts, x: torch.Tensor, grad: torch.Tensor, run) -> list[torch.Tensor]:
    """run(x) through the experts, backward with `grad`: the output and the gradients of x and the weights."""
    x = x.detach().requires_grad_()
    experts.zero_grad(set_to_none=True)
    y = run(x)
    y.backward(grad)
    return [y.detach(), x.grad, *(p.grad for p in experts.parameters())]


def median_ms(device: torch.device, step, repeats: int = 5) -> float:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def grouped_experts_match_loop(check: Check) -> dict:
    """The experts all at once (strata/model/grouped_experts.py: torch's grouped product where the
    device has its kernel, bf16 on compute capability 9.x/10.x) against their per-expert loop on the
    device in bf16: the output and the gradients of the rows and of the weights, relative to the
    largest value; the form taken; the host syncs of its forward and backward (strata's count, and
    CUDA's own sync debug mode: none where the form is 'grouped'); forward + backward times of the
    loop and of the form taken at a larger shape."""
    device, weights = check.device, ("w_gate", "w_up", "w_down")
    torch.manual_seed(0)
    experts = _experts_on(device, len(EXPERT_ROWS), 256, 512)
    counts = torch.tensor(EXPERT_ROWS, device=device)
    x = torch.randn(sum(EXPERT_ROWS), 256, device=device, dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    stacked = tuple(getattr(experts, name) for name in weights)
    path = experts_path(x, stacked, EXPERT_ROWS)
    reference = _experts_step(experts, x, grad, lambda x: loop_experts(x, EXPERT_ROWS, *stacked))
    with HostSyncs() as syncs, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            ours = _experts_step(experts, x, grad, lambda x: experts(x, counts))
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
    cuda_syncs = sum(1 for w in caught if "synchroniz" in str(w.message).lower())
    errors = {name: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
              for name, a, b in zip(("out", "dx", *(f"d{w}" for w in weights)), ours, reference)}
    n, d_model, d_ff, rows = EXPERT_TIMING[device.type]
    big = _experts_on(device, n, d_model, d_ff)
    sizes = torch.bincount(torch.randint(0, n, (rows,), device=device), minlength=n)
    big_x = torch.randn(rows, d_model, device=device, dtype=torch.bfloat16)
    big_grad = torch.randn_like(big_x)
    listed = sizes.tolist()
    loop_ms = median_ms(device, lambda: _experts_step(
        big, big_x, big_grad, lambda x: loop_experts(x, listed, *(getattr(big, w) for w in weights))))
    taken_ms = median_ms(device, lambda: _experts_step(big, big_x, big_grad, lambda x: big(x, sizes)))
    tolerance = 3e-2  # bf16: a few of its 2^-7 steps, the products' sums taken in other orders
    return {"rows_per_expert": EXPERT_ROWS, "path": path, "relative_errors": errors, "tolerance": tolerance,
            "host_syncs": dict(syncs.by_kind), "cuda_sync_warnings": cuda_syncs,
            "timing": {"experts": n, "d_model": d_model, "d_ff": d_ff, "rows": rows, "loop_ms": loop_ms,
                       "taken_ms": taken_ms, "loop_over_taken": loop_ms / taken_ms},
            "passed": max(errors.values()) <= tolerance and (path != "grouped" or syncs.count == cuda_syncs == 0)}


def correctness(check: Check) -> dict:
    out = {"model": "tiny", "steps": CORRECTNESS_STEPS, "reference": "cpu", "device": str(check.device),
           "training": {**{dtype: training_matches_cpu(check, dtype) for dtype in ("fp64", "fp32")},
                        "fp32 offloaded vs on the device": offload_matches_memory(check),
                        "fp64 tiny-moe (router, experts, auxiliary loss)": training_matches_cpu(check, "fp64",
                                                                                                "tiny-moe")},
           "generation": {name: generation_matches_cpu(check, dtype)
                          for name, dtype in (("fp64", torch.float64), ("fp32", torch.float32))},
           "ring attention": {f"{name} window {window}": ring_blocks_match_attention(check, dtype, window)
                              for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
                              for window in (None, 100)},
           # last: a kernel's device-side assert would leave the device unusable for what follows
           "grouped experts": {"bf16": grouped_experts_match_loop(check)}}
    out["passed"] = all(r["passed"] for kind in ("training", "generation", "ring attention", "grouped experts")
                        for r in out[kind].values())
    return out
