"""Compressed gradients (--compress): which tensors PowerSGD compresses and what it sends, the rule
the runtime compresses by (strata/parallel/powersgd.py) and the planner and tests count bytes with.

PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019; PyTorch's DDP communication hook
torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook) approximates each gradient matrix M
(n x m: a parameter's first dimension by the rest) by rank r: P = M Q is all-reduced and
orthogonalised, Q = M^T P is all-reduced, and P Q^T replaces the sum of the ranks' M. A matrix is
compressed only where that pays (PyTorch's `min_compression_rate`): 2 r (n + m) < n m; the rest
(vectors, small or thin matrices) is all-reduced whole.

1-bit Adam (Tang et al., "1-bit Adam", ICML 2021; DeepSpeed's OnebitAdam) sends Adam's momentum,
not the gradient, as one sign bit per element and a scale per piece of a tensor in each chunk of
1/dp of the model (`onebit_pieces`), after warm-up steps of plain Adam that fix the second moment:
an all-to-all of the workers' chunks, each averaged by its owner, and an all-gather of the averages
compressed again (`onebit_wire_bytes`).

0/1 Adam (Lu et al., "Maximizing Communication Efficiency for Large-scale Training via 0/1 Adam",
ICLR 2023, arXiv 2202.06009; DeepSpeed's ZeroOneAdam) has no warm-up: on the steps that update v
(`variance_updates`: every step at first, then at spacings that double after each
var_update_scaler updates) the gradient is all-reduced whole and Adam runs on it; on the others the
gradient is averaged through the same two 1-bit collectives, and m alone takes it
(`zeroone_wire_bytes`)."""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Iterable, Sequence

COMPRESSIONS = ("none", "powersgd", "onebit", "zeroone")
# a matrix is compressed when its r (n + m) elements are less than 1/MIN_COMPRESSION_RATE of n m
MIN_COMPRESSION_RATE = 2


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """A parameter's gradient as the matrix PowerSGD factors: its first dimension by the rest."""
    return shape[0], math.prod(shape[1:])


def compressible(shape: Sequence[int], rank: int) -> bool:
    if len(shape) < 2:
        return False
    n, m = matrix_shape(shape)
    return MIN_COMPRESSION_RATE * rank * (n + m) < n * m


def q_seed(seed: int, name: str) -> int:
    """The seed of the generator a parameter's first PowerSGD Q is drawn from: --seed and the
    parameter's name in the whole model (CRC-32: the same in every process, unlike hash()), so
    that a pipeline stage draws the same Q for a matrix as one process holding the whole model."""
    return seed * 1_000_003 + zlib.crc32(name.encode())


def powersgd_elements(shapes: Iterable[Sequence[int]], rank: int) -> tuple[int, int]:
    """Elements a compressed step all-reduces, in its two rounds: (the P factors with every tensor
    left whole, the Q factors)."""
    first = second = 0
    for shape in shapes:
        if compressible(shape, rank):
            n, m = matrix_shape(shape)
            first, second = first + n * rank, second + m * rank
        else:
            first += math.prod(shape)
    return first, second


def onebit_padded(elements: int, dp: int) -> int:
    """1-bit Adam's flat momentum: the model's elements padded so that each of the dp chunks packs
    whole bytes of 8 signs."""
    return -(-elements // (8 * dp)) * 8 * dp


def onebit_units(elements: int, row: int | None = None) -> list[int]:
    """A tensor's units, each compressed with a scale of its own: the whole tensor, or, for an
    embedding (`row`: its width), each row. An embedding's gradient is zero in the rows of the
    tokens (positions) a batch lacks, most of a vocabulary's; one bit has no zero, so under a
    scale for the whole tensor each such row would move by it, and Adam divides by the square root
    of a rare token's second moment, near zero. With a scale per row, a row with nothing in it
    stays zero (DeepSpeed asks the user for momentum masks of such rows instead)."""
    return [row] * (elements // row) if row else [elements]


def onebit_pieces(sizes: Sequence[int], dp: int) -> list[list[int]]:
    """The flat buffer 1-bit Adam compresses (units of `sizes` elements end to end: onebit_units;
    padded: onebit_padded) cut in dp chunks -> each chunk's pieces, the lengths of the units' parts
    in it in order (the padding is a piece of its own). Each piece is compressed with a scale of
    its own: a model's tensors' gradients differ in size by hundreds of times, and one scale for a
    chunk of many of them moves every element by the same amount (DeepSpeed's optimizers compress
    each parameter tensor on its own)."""
    total = sum(sizes)
    padded = onebit_padded(total, dp)
    chunk = padded // dp
    ends = list(itertools.accumulate(size for size in sizes if size)) + ([padded] if padded > total else [])
    pieces, start, at = [], 0, 0
    for j in range(dp):
        lo, hi, lengths = j * chunk, (j + 1) * chunk, []
        while at < len(ends) and start < hi:
            lengths.append(min(ends[at], hi) - max(start, lo))
            if ends[at] > hi:
                break
            start, at = ends[at], at + 1
        pieces.append(lengths)
    return pieces


def onebit_rows(segments: Sequence[Sequence[int]], dp: int) -> tuple[list[list[list[int]]], int]:
    """1-bit Adam's flat buffer as `segments` (each its units' lengths, padded and cut in dp chunks
    on its own: a tied embedding's copy beside a pipeline is one) -> each segment's pieces per chunk
    (onebit_pieces), and the scales a row of the collectives carries: row j holds every segment's
    chunk j, so the most pieces any j has over the segments (an empty segment has none: its chunks
    are empty, and the pieces come back one list per segment, in order)."""
    pieces = [onebit_pieces(units, dp) for units in segments]
    return pieces, max(sum(len(chunks[j]) for chunks in pieces) for j in range(dp))


def onebit_wire_bytes(elements: int, dp: int, scale_bytes: int, scales: int = 1) -> int:
    """The buffer each of 1-bit Adam's two collectives moves per step (its all-to-all's input, its
    all-gather's output): every chunk's signs packed 8 to a byte, and `scales` scales per chunk (the
    most pieces a chunk has: onebit_pieces; the rows of a collective are equal, a chunk with fewer
    pieces pads its scales)."""
    return onebit_padded(elements, dp) // 8 + dp * scales * scale_bytes


def variance_updates(step: int, scaler: int) -> int:
    """How many of 0/1 Adam's steps 1..step update v, DeepSpeed's ZeroOneAdam policy
    (var_interval, var_counter, var_update_scaler = kappa): v is updated at the multiples of an
    interval that starts at 1 and doubles after each `scaler` updates at it; with kappa 16, steps
    1-16, then 18, 20, .., 48, then 52, 56, .., 112, and so on (about kappa log2(step / kappa)
    updates in all)."""
    count, last, interval = 0, 0, 1
    while True:
        first = (last // interval + 1) * interval  # the level's first multiple past the last update
        if step < first:
            return count
        end = first + (scaler - 1) * interval
        if step <= end:
            return count + (step - first) // interval + 1
        count, last, interval = count + scaler, end, interval * 2


def updates_variance(step: int, scaler: int) -> bool:
    """Whether 0/1 Adam's step `step` (1 is the first) updates v, and so all-reduces the gradient whole."""
    return variance_updates(step, scaler) > variance_updates(step - 1, scaler)


def zeroone_wire_bytes(steps: int, scaler: int, elements: int, dp: int, scale_bytes: int, gradient_bytes: int,
                       scales: int = 1) -> int:
    """The buffers 0/1 Adam's first `steps` steps move, an all-reduce counted as its two rounds (a
    ring sends (dp - 1)/dp of each): a step that updates v all-reduces the gradient buffer
    (`gradient_bytes`, ZeRO-0's), any other sends onebit_wire_bytes twice (the all-to-all of the
    workers' compressed gradients and the all-gather of the servers' averages)."""
    whole = variance_updates(steps, scaler)
    return 2 * whole * gradient_bytes + 2 * (steps - whole) * onebit_wire_bytes(elements, dp, scale_bytes, scales)
