"""Compressed gradients (--compress): which tensors PowerSGD compresses and what it sends, the rule
the runtime compresses by (strata/parallel/powersgd.py) and the planner and tests count bytes with.

PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019; PyTorch's DDP communication hook
torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook) approximates each gradient matrix M
(n x m: a parameter's first dimension by the rest) by rank r: P = M Q is all-reduced and
orthogonalised, Q = M^T P is all-reduced, and P Q^T replaces the sum of the ranks' M. A matrix is
compressed only where that pays (PyTorch's `min_compression_rate`): 2 r (n + m) < n m; the rest
(vectors, small or thin matrices) is all-reduced whole.

1-bit Adam (Tang et al., "1-bit Adam", ICML 2021; DeepSpeed's OnebitAdam) sends Adam's momentum,
not the gradient, as one sign bit per element and one scale per chunk of 1/dp of the model, after
warm-up steps of plain Adam that fix the second moment: an all-to-all of the workers' chunks, each
averaged by its owner, and an all-gather of the averages compressed again (`onebit_wire_bytes`)."""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Sequence

COMPRESSIONS = ("none", "powersgd", "onebit")
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


def onebit_wire_bytes(elements: int, dp: int, scale_bytes: int) -> int:
    """The buffer each of 1-bit Adam's two collectives moves per step (its all-to-all's input, its
    all-gather's output): every chunk's signs packed 8 to a byte, and each chunk's scale."""
    return onebit_padded(elements, dp) // 8 + dp * scale_bytes
