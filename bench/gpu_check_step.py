"""bench/gpu_check.py's `step` part: what issue 53 changed in the training step, on the device.

  syncs           host syncs in a training step (the second: the first makes what is cached), by
                  strata's counter and, on CUDA, by torch.cuda.set_sync_debug_mode("warn")'s warnings;
                  a dense model (budget: 1 a step) and a mixture of experts (2 a step, plus 1 per layer
                  and micro-batch where the experts run the padded form or the loop)
  initial_values  the same elements made on the device and on the CPU (strata/model/initial_values.py),
                  bit for bit, for the shapes of a LLaMA-3 8B layer (quick: tiny's)
  startup         seconds to make an 8B-shaped model's weights on the device from (seed, name, index),
                  against drawing one layer's tensors with torch.randn on the CPU as before (scaled to
                  the layers)
  attention       fused attention's blocks against one SDPA call: the ring's (cp 4) and a sliding
                  window's in one process (bench/gpu_check_attention.py)
  offload_overlap the share of an offload tier's copies that runs beside compute kernels, from a
                  profiler trace, on the copy stream and as before (bench/offload_overlap.py)
  chunked_loss    the loss's peak memory at a 131,072-token vocabulary, chunked and not: CUDA's
                  max_memory_allocated over the loss's forward and backward (the CPU: LiveBytes)

Quick mode runs the same code on tiny shapes on the CPU."""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import TYPE_CHECKING

import gpu_check_attention
import offload_overlap
import torch

from strata.config import train_config
from strata.distributed import comm
from strata.distributed.host_syncs import HostSyncs
from strata.memory.live_bytes import LiveBytes
from strata.model import loss as chunking
from strata.model.config import ModelConfig
from strata.model.initial_values import initial_value
from strata.model.presets import get_preset
from strata.model.transformer import build_model
from strata.train import trainer

if TYPE_CHECKING:
    from gpu_check_parts import Check

BIG = "llama3-8b"  # the start-up's and the initial values' shapes
VOCAB = 131072


def step(check: Check) -> dict:
    quick = check.shapes.llm == "tiny"
    return {"attention": gpu_check_attention.attention(check, quick),
            "offload_overlap": offload_overlap.measure(check.device, quick),
            "syncs": {model: step_syncs(check, model) for model in ("tiny", "tiny-moe")},
            "initial_values": initial_values_match(check, "tiny" if quick else BIG),
            "startup": startup_seconds(check, "tiny" if quick else BIG),
            "chunked_loss": chunked_loss_memory(check, 256 if quick else 8192, 16 if quick else 4096,
                                                8 * 2**20 if quick else chunking.LOGITS_CHUNK_BYTES)}


def step_syncs(check: Check, model: str) -> dict:
    dtype = "bf16" if check.device.type == "cuda" else "fp32"
    run = trainer.setup(train_config(model=model, dtype=dtype, steps=2, micro_batch=2, global_batch=8,
                                     device=check.device.type, progress=False, eval_batches=1, peak_flops=1e12))
    trainer.train_step(run, 0)
    cuda_warnings = 0
    with warnings.catch_warnings(record=True) as caught, HostSyncs() as syncs:
        warnings.simplefilter("always")
        with _sync_debug(check.device):
            trainer.train_step(run, 1)
        cuda_warnings = sum("synchroniz" in str(w.message) for w in caught)
    run.parallel.close()
    comm.close_streams()
    budget = 1 if model == "tiny" else 2 + 4 * run.model_cfg.n_layers  # 4 micro-batches, 1 read a layer
    return {"dtype": dtype, "strata": dict(syncs.by_kind), "strata_total": syncs.count, "cuda_warnings": cuda_warnings,
            "budget": budget, "passed": syncs.count <= budget}


@contextlib.contextmanager
def _sync_debug(device: torch.device):
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("warn")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def initial_values_match(check: Check, model: str) -> dict:
    """Each tensor of one block, the embedding and a slice of it: made on the device, equal to the
    CPU's bit for bit."""
    cfg = get_preset(model)
    meta = build_model(cfg, seed=None)
    names = [n for n, _ in meta.named_parameters() if n.startswith(("embed.", "blocks.0."))]
    shapes = dict((n, tuple(p.shape)) for n, p in meta.named_parameters())
    differing = []
    for name in names:  # a block of up to 64 rows of each, and the whole of those small enough
        shape = shapes[name]
        box = [(shape[0] // 3, shape[0] // 3 + min(64, max(1, shape[0] // 4))), *[(0, n) for n in shape[1:]]]
        for piece in ((None, box) if len(shape) == 1 or shape[0] * shape[1] <= 2**22 else (box,)):
            on_device = initial_value(name, shape, 0, cfg.n_layers, cfg.norm, piece, device=check.device)
            on_cpu = initial_value(name, shape, 0, cfg.n_layers, cfg.norm, piece)
            if not torch.equal(on_device.cpu(), on_cpu):
                differing.append(name + (" (a block of it)" if piece else ""))
    return {"model": model, "tensors": len(names), "differing": differing, "passed": not differing}


def startup_seconds(check: Check, model: str) -> dict:
    """The weights made on the device, one tensor at a time (what a rank holding everything makes),
    against one layer's tensors drawn with torch.randn on the CPU, times the layers (the old way)."""
    cfg = get_preset(model)
    meta = build_model(cfg, seed=None)
    shapes = [(n, tuple(p.shape)) for n, p in meta.named_parameters()]
    synchronize(check.device)
    started = time.perf_counter()
    made = 0
    for name, shape in shapes:
        made += initial_value(name, shape, 0, cfg.n_layers, cfg.norm, device=check.device).numel()
    synchronize(check.device)
    on_device = time.perf_counter() - started
    one_layer = [shape for name, shape in shapes if name.startswith("blocks.0.")]
    started = time.perf_counter()
    for shape in one_layer:
        torch.randn(shape, generator=torch.Generator().manual_seed(0))
    randn_per_layer = time.perf_counter() - started
    return {"model": model, "elements": made, "made_on_device_s": on_device,
            "cpu_randn_estimate_s": randn_per_layer * cfg.n_layers}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def chunked_loss_memory(check: Check, tokens: int, width: int, chunk_bytes: int) -> dict:
    """Bytes over the loss's forward and backward beyond what existed before, chunked (chunks of
    `chunk_bytes` of fp32 logits: strata's default on a GPU) and not, bf16 autocast on CUDA (fp32
    on the CPU)."""
    cfg = ModelConfig(vocab_size=VOCAB, n_layers=1, d_model=width, n_heads=2, d_ff=32, max_seq_len=tokens)
    model = build_model(cfg, device=check.device, seed=0)
    h = torch.randn(1, tokens, width, device=check.device, requires_grad=True)
    targets = torch.randint(0, VOCAB, (1, tokens), device=check.device)
    out = {"tokens": tokens, "d_model": width, "whole_fp32_logits": tokens * VOCAB * 4, "chunk_bytes": chunk_bytes}
    for name, budget in (("unchunked", 2**62), ("chunked", chunk_bytes)):
        out[name] = _loss_peak(check.device, model, h, targets, budget)
        h.grad = None
        model.zero_grad(set_to_none=True)
    out["passed"] = out["chunked"] < out["unchunked"] / 2
    return out


def _loss_peak(device: torch.device, model, h, targets, budget: int) -> int:
    before = chunking.LOGITS_CHUNK_BYTES
    chunking.LOGITS_CHUNK_BYTES = budget
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            with autocast:
                loss = model.loss(h, targets)
            loss.backward()
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device) - base
        with LiveBytes() as counted:
            loss = model.loss(h, targets)
            loss.backward()
        return counted.peak
    finally:
        chunking.LOGITS_CHUNK_BYTES = before
