"""Initial weights as a pure function of (seed, parameter name, element index), so that a rank
makes only the elements it holds (issue 53: weights made where they live).

A generator's stream (torch.randn) can only be read from its start: to hold a tensor-parallel
slice or a ZeRO-3 shard, every rank used to draw the whole logical tensor and keep its piece, so a
70B start-up drew every parameter on every rank. Here each element's value is computed from its
own index, as JAX's counter-based keys do:

  u = hash32(low 32 bits of the index ^ hash32(k ^ high bits))     k from the seed and the name
  x = Q[u >> 16] + (Q[(u >> 16) + 1] - Q[u >> 16]) * (u & 0xffff) / 2**16

hash32 is an integer hash of Wellons' "lowbias32" form, with the multipliers of his hash-prospector's
lower-bias variant (both under 2**31, so that no product passes int64); Q holds the standard normal's quantiles at 2**16 + 1
evenly spaced probabilities (j + 1/2) / (2**16 + 1), so x is a normal truncated at 4.3 sigma
(probability 1.5e-5 lost in the tails) with a piecewise-linear CDF. Every step is an integer
operation or one correctly rounded float operation per torch kernel, so an element's value is the
same bit for bit whatever piece it is computed in, and on any device: a run's weights do not depend
on its layout. A slice of a tensor (tensor parallelism's cut, a vocabulary's padding) and a range
of a flat shard (ZeRO-3) are described by `box` and `flat`; `GeneratedElements` counts what is
made, so a test can show a rank makes no more than it holds."""

from __future__ import annotations

import math
import zlib
from functools import lru_cache

import torch

INIT_STD = 0.02  # GPT-2's initialisation; residual output projections are scaled by 1/sqrt(2L)
RESIDUAL_OUTPUTS = ("attn.wo.weight", "mlp.w_down.weight", "mlp.w_out.weight", "mlp.experts.w_down",
                    "mlp.shared.w_down.weight")
QUANTILE_BITS = 16  # of the hash's 32: the quantile cell; the other 16 place x inside it
_MASK32 = 0xFFFFFFFF
CHUNK = 2 ** 16  # elements hashed at a time on a CPU: the dozen passes over them stay in the cache
DEVICE_CHUNK = 2 ** 24  # on an accelerator: few launches (each chunk reads its top index once)


class GeneratedElements:
    """Counts the elements initial_value makes while it is entered (nested counters all count)."""
    active: list["GeneratedElements"] = []

    def __init__(self):
        self.elements = 0

    def __enter__(self) -> "GeneratedElements":
        GeneratedElements.active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        GeneratedElements.active.remove(self)


def _count(n: int) -> None:
    for counter in GeneratedElements.active:
        counter.elements += n


def _hash32(x):
    """A bijection on 32-bit values with low bias (x ^= x >> 16; x *= 0x21f0aaad; x ^= x >> 15;
    x *= 0x735a2d97; x ^= x >> 15, mod 2**32); x a Python int or an int64 tensor, which it
    overwrites. x < 2**32 and the multipliers < 2**31: the products stay below 2**63."""
    if not isinstance(x, torch.Tensor):
        x ^= x >> 16
        x = (x * 0x21F0AAAD) & _MASK32
        x ^= x >> 15
        x = (x * 0x735A2D97) & _MASK32
        return x ^ (x >> 15)
    x.bitwise_xor_(x >> 16).mul_(0x21F0AAAD).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15).mul_(0x735A2D97).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 15)


@lru_cache(maxsize=None)
def _quantiles(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Q and its successive differences, in fp64, computed on the CPU (once) and moved whole."""
    cells = 2 ** QUANTILE_BITS
    probabilities = (torch.arange(cells + 1, dtype=torch.float64) + 0.5) / (cells + 1)
    q = torch.special.ndtri(probabilities)
    return q[:-1].to(device), (q[1:] - q[:-1]).to(device)


def standard_normal(index: torch.Tensor, seed: int, name: str) -> torch.Tensor:
    """fp32 values, one per int64 element index (< 2**63), on the index's device; index is overwritten."""
    key = _hash32(zlib.crc32(name.encode()) ^ _hash32((seed & _MASK32) ^ _hash32((seed >> 32) & _MASK32)))
    out = torch.empty(index.shape, device=index.device)
    start, width = _quantiles(index.device)
    chunk = CHUNK if index.device.type == "cpu" else DEVICE_CHUNK
    for part, values in zip(index.view(-1).split(chunk), out.view(-1).split(chunk)):
        high = part >> 32
        # per element only past 2**32 elements (a tensor of 4G elements); the same value as the scalar
        part_key = _hash32(key) if int(high.max()) == 0 else _hash32(high.bitwise_xor_(key))
        u = _hash32(part.bitwise_and_(_MASK32).bitwise_xor_(part_key))
        within = (u & (2 ** (32 - QUANTILE_BITS) - 1)).to(torch.float64).div_(2 ** (32 - QUANTILE_BITS))
        cell = u.bitwise_right_shift_(32 - QUANTILE_BITS)
        values.copy_(width[cell].mul_(within).add_(start[cell]))
    return out


def element_indices(shape: tuple[int, ...], box: list[tuple[int, int]] | None = None,
                    flat: tuple[int, int] | None = None, device="cpu") -> tuple[torch.Tensor, torch.Tensor | None]:
    """The logical tensor's flat indices of the box's elements [flat[0], flat[1]) in row-major
    order (all of them without flat), and which of them lie past `shape` (a padded vocabulary's
    rows, whose value is 0; None when none do)."""
    box = box or [(0, n) for n in shape]
    sizes = [end - start for start, end in box]
    lo, hi = flat or (0, math.prod(sizes))
    position = torch.arange(lo, hi, dtype=torch.int64, device=device)
    index, outside = torch.zeros_like(position), None
    stride = 1
    for dim in reversed(range(len(shape))):
        coordinate = position % sizes[dim] + box[dim][0]
        position = position // sizes[dim]
        index += coordinate * stride
        stride *= shape[dim]
        if box[dim][1] > shape[dim]:
            past = coordinate >= shape[dim]
            outside = past if outside is None else outside | past
    return index, outside


def initial_value(name: str, shape: tuple[int, ...], seed: int, n_layers: int, norm: str = "rmsnorm",
                  box: list[tuple[int, int]] | None = None, flat: tuple[int, int] | None = None,
                  device="cpu") -> torch.Tensor:
    """The initial value of the logical (unsharded) parameter `name` of `shape`, in fp32: all of
    it, or the block `box` ((start, end) per dimension; an end past the shape is padding, 0), or
    the elements [flat[0], flat[1]) of that block flattened (a 1-D tensor). Every norm (attn_norm,
    mlp_norm, final_norm, embed_norm, attn.q_norm, attn.k_norm) starts as the identity: weight 1,
    or 0 for the norm that scales by (1 + weight) (cfg.norm); biases start at 0."""
    box = box or [(0, n) for n in shape]
    out_shape = (flat[1] - flat[0],) if flat is not None else tuple(end - start for start, end in box)
    _count(math.prod(out_shape))
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias" or ("norm" in name and leaf == "weight"):
        one = "norm" in name and leaf == "weight" and norm != "gemma_rmsnorm"
        value = torch.ones(out_shape, device=device) if one else torch.zeros(out_shape, device=device)
        if one and any(end > n for (_, end), n in zip(box, shape)):
            value = value.reshape(-1).masked_fill(element_indices(shape, box, flat, device)[1], 0.0).view(out_shape)
        return value
    index, outside = element_indices(shape, box, flat, device)
    std = INIT_STD / math.sqrt(2 * n_layers) if name.endswith(RESIDUAL_OUTPUTS) else INIT_STD
    value = standard_normal(index, seed, name) * std
    if outside is not None:
        value = value.masked_fill(outside, 0.0)
    return value.view(out_shape)
