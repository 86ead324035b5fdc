"""How this CPU runs a training step's kernels, for the planner's `Kernels` (strata/plan/compute.py):
`--model`'s GEMMs, fused attention, an elementwise add and an exponential each timed alone, then
two numbers fitted to real training steps of the model (`kernel_costs`). Part of `strata
calibrate` (strata/tools/calibrate.py)."""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import asdict, replace

import torch

from strata.config import train_config
from strata.model.presets import get_preset
from strata.plan.compute import StepWork, attention_flops, block_gemms, head_gemm
from strata.plan.cost import Cluster, estimate
from strata.plan.hardware import Device, Kernels
from strata.plan.inputs import CPU_LOCAL, workload
from strata.rules.layout import Layout
from strata.tools.bench_generate import least_squares
from strata.train.trainer import train


def step_time(model: str, micro_batch: int, micro_batches: int = 1, seq_len: int = 128, steps: int = 7) -> float:
    """Median seconds of a real fp32 training step of `model` on one process: `micro_batches`
    micro-batches of `micro_batch` sequences (the first step, which warms up, left out)."""
    cfg = train_config(model=model, seq_len=seq_len, micro_batch=micro_batch, global_batch=micro_batch * micro_batches,
                      steps=steps, progress=False, peak_flops=1e12, eval_batches=1)
    return statistics.median(train(cfg)["step_times"][1:])


def _median_seconds(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


MICRO_BATCHES = (1, 2, 4, 8)


def gemm_curve(cfg, rate: float, bandwidth: float, seq_len: int) -> tuple[float, float]:
    """(the largest GEMMs' fraction of `rate`, the fixed cost per GEMM), fitted to fp32 GEMMs of the
    model's own shapes (each block's and the head's, at every calibrated micro-batch, whole and
    split two ways as tensor parallelism splits them) with the
    planner's formula: max(FLOPs at the fraction, bytes at the bandwidth) + the fixed cost."""
    measured = []
    for b, tp in itertools.product(MICRO_BATCHES, (1, 2)):
        work = StepWork(cfg, b * seq_len, b, seq_len, tp, False, True, 4)
        for m, n, k in sorted(set(block_gemms(work) + [head_gemm(work)])):
            x, w = torch.randn(int(m), int(k)), torch.randn(int(k), int(n))
            measured.append(((m, n, k), _median_seconds(lambda: torch.mm(x, w))))
    best = None  # the fit in relative error, so the small GEMMs count as much as the large ones
    for fraction, overhead in itertools.product([0.2 + 0.01 * i for i in range(131)], [2e-6 * i for i in range(51)]):
        curve = Kernels(fraction, overhead, 1.0, 1.0, 0.0)
        error = sum((curve.gemm_seconds(*shape, rate, bandwidth, 4) / seconds - 1) ** 2 for shape, seconds in measured)
        if best is None or error < best[0]:
            best = (error, fraction, overhead)
    return best[1], best[2]


def attention_fraction(cfg, rate: float, seq_len: int, micro_batch: int = 4) -> float:
    """Fused attention (SDPA, causal) forward and backward at the model's shape, over `rate`, its
    FLOPs counted as the planner counts them (12·s·h per token)."""
    shape = (micro_batch, cfg.n_heads, seq_len, cfg.head_dim)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))

    def step():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    flops = 3 * attention_flops(StepWork(cfg, micro_batch * seq_len, micro_batch, seq_len, 1, False, True, 4))
    return flops / _median_seconds(step) / rate


def elementwise_fraction(cfg, bandwidth: float, seq_len: int) -> float:
    """The rate of an elementwise kernel on tensors of the model's activations (b x s x d_model and
    b x s x d_ff, b over the calibrated micro-batches), over `bandwidth` (a large copy's): the slope
    of time against bytes moved (an add reads two and writes one), fitted over those sizes, so a
    kernel's fixed cost does not count against its rate. Tensors this size stay in the caches on a
    CPU, so the fraction can exceed 1."""
    moved, seconds = [], []
    for b, width in itertools.product(MICRO_BATCHES, (cfg.d_model, cfg.d_ff)):
        x, y = torch.randn(b * seq_len, width), torch.randn(b * seq_len, width)
        out = torch.empty_like(x)
        moved.append(3 * x.numel() * x.element_size())
        seconds.append(_median_seconds(lambda: torch.add(x, y, out=out), repeats=31))
    slope, _, _ = least_squares(moved, seconds)
    return 1 / slope / bandwidth if slope > 0 else 1e3


def exponential_seconds(cfg, elementwise_rate: float, seq_len: int) -> float:
    """Seconds an exponential adds per element beyond an elementwise pass over its bytes: the slope
    of torch.exp's time against elements on tensors of the logits' shape (micro-batch x sequence x
    vocabulary, over the calibrated micro-batches), less the 8 bytes it reads and writes at
    `elementwise_rate`. On this CPU an exponential costs about ten times an add's pass, and the
    loss runs one per logit forward and one backward: at `small`'s vocabulary, 40% of the head."""
    elements, seconds = [], []
    for b in MICRO_BATCHES:
        x = torch.randn(b * seq_len, cfg.vocab_size)
        out = torch.empty_like(x)
        elements.append(x.numel())
        seconds.append(_median_seconds(lambda: torch.exp(x, out=out)))
    slope, _, _ = least_squares(elements, seconds)
    return max(0.0, slope - 8 / elementwise_rate)


# (micro-batch, micro-batches) of the real training steps the GEMMs' rate inside a step and the
# cost per kernel are fitted to: how a step grows with the sequences in a micro-batch (the GEMMs),
# and with the micro-batches of a step (the kernels)
STEP_GRID = ((1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (1, 4), (2, 2))
# The grid's step that calibration also times in each of its one-process rounds: the machine's
# level over the whole calibration, which the grid (timed once, at the end, in under a minute) is
# scaled to. Before the rounds timed it, the grid's 4x1 came out 6% under to 18% over the median
# of the rounds' forward and backward steps of that shape in five calibrations here (the two run
# within 3% of each other back to back), and every prediction moved with it.
REFERENCE_STEP = (4, 1)


def step_key(micro_batch: int, micro_batches: int) -> str:
    """A grid step's name in the profile's `measured_steps`: "4x1"."""
    return f"{micro_batch}x{micro_batches}"


REFERENCE_KEY = step_key(*REFERENCE_STEP)


def reference_step_seconds(model: str, seq_len: int = 128) -> float:
    """REFERENCE_STEP of `model` timed now, at the sequence length the grid uses."""
    return step_time(model, *REFERENCE_STEP, seq_len=min(seq_len, get_preset(model).max_seq_len))


def kernel_costs(model: str, rate: float, bandwidth: float, seq_len: int = 128,
                 references: tuple[float, ...] = (), sweeps: int = 1) -> dict:
    """This CPU's `Kernels` (strata/plan/compute.py): the GEMM curve, attention and the elementwise
    rate, each measured alone; then real training steps of `model` over STEP_GRID, and two numbers
    that bring the planner's step time closest to them (least squares in relative error): how much
    slower the GEMMs run inside a step than alone (the grid's micro-batch sizes tell it), and what
    each kernel launched costs beyond its work (the dispatch, autograd's bookkeeping, the Python
    between kernels; the grid's micro-batch counts tell it).

    `references`: REFERENCE_STEP timed earlier in the calibration. The grid's steps are scaled by
    the median of those and the grid's own REFERENCE_STEP over the latter before the fit: the
    grid's shape (how a step grows with sequences and micro-batches), at the calibration's level.

    `sweeps`: the grid is timed that many times over, each step's median (against its sweep's
    REFERENCE_STEP) kept. Timed once, one step of seven caught in a slow spell (1x2 at 0.479 s,
    against 0.36 s in two other calibrations) more than doubled the fitted cost per kernel, and
    every micro-batch-1 layout came out 10-20% slow."""
    cfg = get_preset(model)
    seq_len = min(seq_len, cfg.max_seq_len)
    alone, gemm_overhead = gemm_curve(cfg, rate, bandwidth, seq_len)
    attention = attention_fraction(cfg, rate, seq_len)
    device = Device(CPU_LOCAL, 2**40, {"fp32": rate}, bandwidth, None)
    element_fraction = elementwise_fraction(cfg, bandwidth, seq_len)
    exp_s = exponential_seconds(cfg, bandwidth * element_fraction, seq_len)

    def predicted(b: int, m: int, gemm_fraction: float, kernel_overhead: float) -> float:
        kernels = Kernels(gemm_fraction, gemm_overhead, attention, element_fraction, kernel_overhead, exp_s)
        cluster = Cluster(replace(device, kernels=kernels), 1, 1, overlap=False)
        return estimate(workload(cfg, b * m, seq_len, "fp32"), cluster, Layout(micro_batch=b)).step_time_s

    # The step is (near enough: its GEMMs are bound by their FLOPs) linear in both numbers:
    # other + u x gemms + x x kernels, u the GEMMs' time in a step over their time alone.
    timings = [{(b, m): step_time(model, b, m, seq_len) for b, m in STEP_GRID} for _ in range(sweeps)]
    # each step's median over the sweeps of its time against the sweep's own REFERENCE_STEP: the
    # machine's speed moves between sweeps too (4x1 at 0.731, 0.720 and 0.621 s in one calibration),
    # and a median of raw times takes one step from a slow sweep and another from a fast one
    grid_reference = statistics.median(sweep[REFERENCE_STEP] for sweep in timings)
    timed = {point: grid_reference * statistics.median(sweep[point] / sweep[REFERENCE_STEP] for sweep in timings)
             for point in STEP_GRID}
    level = statistics.median([*references, timed[REFERENCE_STEP]])
    rows = []
    for b, m in STEP_GRID:
        other = predicted(b, m, 1e12, 0.0)
        rows.append((timed[b, m] * level / timed[REFERENCE_STEP], other, predicted(b, m, alone, 0.0) - other,
                     predicted(b, m, 1e12, 1.0) - other))
    scale, overhead = _relative_least_squares([(t, other, (gemms, kernels)) for t, other, gemms, kernels in rows])
    if overhead < 0:  # fewer parameters rather than a negative cost
        (scale,), overhead = _relative_least_squares([(t, other, (gemms,)) for t, other, gemms, _ in rows]), 0.0
    gemm_fraction = min(max(alone / max(scale, 1e-9), 0.2), 2.0)
    kernels = Kernels(gemm_fraction, gemm_overhead, attention, element_fraction, overhead, exp_s)
    return {"kernels": asdict(kernels), "kernels_model": model, "gemm_fraction_alone": alone,
            # measured_s: as fitted, at the level; timed_s: the grid's (sweeps_s' median, as above)
            "measured_steps": {step_key(b, m): {"measured_s": round(t, 6), "timed_s": round(timed[b, m], 6),
                                            "sweeps_s": [round(sweep[b, m], 6) for sweep in timings],
                                            "predicted_s": round(predicted(b, m, gemm_fraction, overhead), 6)}
                               for (b, m), (t, *_) in zip(STEP_GRID, rows)},
            "reference_step": {"steps": REFERENCE_KEY, "level_s": level,
                               "rounds_s": list(references), "grid_s": timed[REFERENCE_STEP]}}


def _relative_least_squares(rows: list[tuple[float, float, tuple[float, ...]]]) -> list[float]:
    """The coefficients c minimising sum((other + c . terms) / measured - 1)^2 over rows of
    (measured, other, terms): the normal equations of the terms over the measured time."""
    a = [[x / t for x in terms] for t, _, terms in rows]
    r = [1 - other / t for t, other, _ in rows]
    n = len(a[0])
    gram = torch.tensor([[sum(row[i] * row[j] for row in a) for j in range(n)] for i in range(n)], dtype=torch.float64)
    rhs = torch.tensor([sum(row[i] * y for row, y in zip(a, r)) for i in range(n)], dtype=torch.float64)
    # least squares, not solve: on a loaded machine a term can measure as nothing in every row (a
    # singular Gram matrix, which crashed a calibration); its coefficient then comes out 0
    return torch.linalg.lstsq(gram, rhs[:, None], driver="gelsd").solution[:, 0].tolist()
