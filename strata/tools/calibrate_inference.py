"""`strata calibrate --inference`: what `strata plan --inference` needs on any device (a CPU, or
the user's own GPU): its memory bandwidth and the decode step's per-layer and per-token
overheads. The training calibration is strata/tools/calibrate.py."""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

from strata.distributed.mesh import pick_device
from strata.distributed.timing import synchronize_stream
from strata.infer.generate import generate
from strata.model.presets import get_preset
from strata.model.transformer import build_model
from strata.plan.inputs import load_profile
from strata.tools.bench_generate import least_squares
from strata.tools.calibrate import matmul_rate, total_memory


def decode_seconds(model, tokens: int = 32, repeats: int = 2, batch: int = 1) -> float:
    """Median seconds per decode step of strata's generation loop (after the first token)."""
    times = [_one_decode(model, tokens, batch) for _ in range(repeats + 1)]  # the first run warms up
    return statistics.median(times[1:])


def _one_decode(model, tokens: int, batch: int = 1) -> float:
    stamps = [time.perf_counter() for _ in generate(model, [[1, 2, 3, 4]] * batch, tokens)]
    synchronize_stream(next(model.parameters()).device)
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def interleaved_decode_seconds(models: list, rounds: int = 3, tokens: int = 32) -> list[float]:
    """decode_seconds of each model, timed round by round (one run of each per round, after a
    warm-up round), so that a burst of load on a shared machine falls on every model alike
    rather than on one layer count, which would tilt the slope against layers."""
    times = [[] for _ in models]
    for round_ in range(rounds + 1):
        for model, own in zip(models, times):
            seconds = _one_decode(model, tokens)
            if round_:
                own.append(seconds)
    return [statistics.median(own) for own in times]


def decode_bandwidth(device: torch.device, dtype, batches=(1, 2, 4, 8, 16, 32), n: int = 4096) -> dict[str, float]:
    """Bytes/s at which a linear layer streams its weight for a batch of b tokens: an n x n weight
    (64 MiB in fp32, larger than the caches), timed for each b. As b grows the layer turns
    compute-bound and the effective bandwidth falls: the curve holds both sides of the roofline."""
    import torch.nn.functional as F
    weight = torch.randn(n, n, dtype=dtype, device=device)
    out = {}
    for b in batches:
        x = torch.randn(b, n, dtype=dtype, device=device)
        times = []
        for _ in range(8):
            synchronize_stream(device)
            started = time.perf_counter()
            F.linear(x, weight)
            synchronize_stream(device)
            times.append(time.perf_counter() - started)
        out[str(b)] = weight.numel() * weight.element_size() / statistics.median(times[2:])
    return out


def device_matmul_rate(device: torch.device, dtype, n: int = 1024, seconds: float = 1.0) -> float:
    """FLOP/s of square matmuls on `device` (the serving roofline's compute side)."""
    if device.type == "cpu":
        return matmul_rate(seconds, 512)
    a = torch.randn(n * 4, n * 4, dtype=dtype, device=device)
    torch.mm(a, a)
    synchronize_stream(device)
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        torch.mm(a, a)
        synchronize_stream(device)
        done += 1
    return done * 2 * (4 * n) ** 3 / (time.perf_counter() - started)


def inference_overheads(device: torch.device, dtype=torch.float32, widths: tuple[int, ...] | None = None) -> dict:
    """What a decode step costs on `device`, as the serving planner models it: per layer, an
    overhead plus the layer's weight bytes over the bandwidth a decode reaches; per step, an
    overhead. Models of 1, 2 and 4 layers at three widths are decoded by strata's own loop: the
    slope of seconds per step against layers is the time of a layer at that width, and the line
    of that time against the layer's bytes gives the bandwidth (1/slope). The per-layer overhead
    is read at the narrowest width, whose weights are a few hundred kilobytes: its layer time less
    those bytes over the bandwidth. (The line's intercept, used before, is tilted by caches: a
    layer that fits in them streams faster than one that does not, and a line through both misses
    the narrow end.) The per-step overhead is the narrowest width's time at no layers. How the
    bandwidth falls as the batch grows (the layer turning compute-bound) is scaled from a linear
    layer timed at each batch size. widths: the three model widths (default 128, 1024, 2048 on a
    GPU; 128, 512, 1024 on a CPU); the GPU check's quick mode passes narrower ones to run the same
    measurement in seconds."""
    import dataclasses

    size = torch.tensor([], dtype=dtype).element_size()
    widths = widths or ((128, 512, 1024) if device.type == "cpu" else (128, 1024, 2048))
    layers = (1, 2, 4)
    layer_bytes, layer_seconds, fixed = [], [], []
    for width in widths:
        cfg = dataclasses.replace(get_preset("tiny"), d_model=width, n_heads=width // 64, n_kv_heads=width // 64,
                                  d_ff=2 * width, vocab_size=512, max_seq_len=128)
        seconds = interleaved_decode_seconds([build_model(dataclasses.replace(cfg, n_layers=n), device, dtype, seed=0)
                                              for n in layers])
        slope, intercept, _ = least_squares(list(layers), seconds)
        block = dataclasses.replace(cfg, n_layers=2).num_params() - dataclasses.replace(cfg, n_layers=1).num_params()
        layer_bytes.append(block * size)
        layer_seconds.append(slope)
        fixed.append(intercept)
    inverse_bandwidth, _, r2 = least_squares(layer_bytes, layer_seconds)
    bandwidth = 1 / inverse_bandwidth if inverse_bandwidth > 0 else float("inf")
    per_layer = layer_seconds[0] - layer_bytes[0] / bandwidth
    by_batch = decode_bandwidth(device, dtype)
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": str(dtype).removeprefix("torch."), "memory_bandwidth": bandwidth,
            "decode_bandwidth": {b: bandwidth * bw / by_batch["1"] for b, bw in by_batch.items()},
            "matmul_flops": device_matmul_rate(device, dtype),
            "memory_bytes": torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
            else total_memory(),
            "per_layer_s": max(per_layer, 0.0), "per_token_s": max(fixed[0], 0.0), "fit_r2": r2,
            # an accelerator's host issues a layer's kernels ahead of the stream; a CPU does both
            "per_layer_on_host": device.type != "cpu",
            "points": {str(w): {"layer_bytes": nb, "layer_s": t} for w, nb, t in zip(widths, layer_bytes, layer_seconds)}}


def calibrate_inference(device: str, out: str) -> dict:
    """Measure the serving overheads on `device` and add them to the profile at `out` (kept
    beside the training calibration when there is one)."""
    dev = pick_device(device)
    measured = inference_overheads(dev, torch.float16 if dev.type == "cuda" else torch.float32)
    profile = load_profile(out) if os.path.isfile(out) else {}
    profile["inference"] = measured
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(profile, f, indent=1)
    print(f"{measured['device']}: a decode step reads weights at {measured['memory_bandwidth'] / 1e9:.1f} GB/s "
          f"(batch 1; {measured['decode_bandwidth']['32'] / 1e9:.1f} GB/s at batch 32) and costs "
          f"{measured['per_layer_s'] * 1e6:.0f} us per layer + {measured['per_token_s'] * 1e6:.0f} us per step "
          f"beyond that (fit R² {measured['fit_r2']:.3f})\nwrote {out}")
    return measured
