"""The optimizers, and the bytes of state each keeps per parameter: the one table the planner reads
(strata/plan/memory.py) and any command that takes --optimizer (strata plan's is its only one: the
trainer runs AdamW alone, `runtime` below, and has no --optimizer to refuse).

Every state is fp32 (strata's mixed precision keeps fp32 gradients and masters, and an optimizer
keeps its moments in the dtype of the gradients it reads):
- AdamW (Loshchilov & Hutter 2019): two moments, 8 bytes per parameter.
- SGD with momentum: one, 4.
- Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", arXiv 2302.06675):
  one momentum, 4; the update is its sign.
- Adafactor (Shazeer & Stern 2018, arXiv 1804.04235): the second moment of a matrix factored into
  its rows' and its columns' means, r + c values for an (r, c) matrix (a stacked (n, r, c) tensor:
  n(r + c), as transformers' Adafactor factors the last two dimensions); a vector keeps its whole
  second moment. No first moment by default (beta1 None in the paper and in transformers);
  `adafactor-momentum` adds one, 4 bytes per parameter.

Names only (no torch): what a name costs is arithmetic on the parameters' shapes."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from strata.errors import ConfigError

STATE_BYTES = 4  # fp32 moments


@dataclass(frozen=True)
class Optimizer:
    name: str
    whole_moments: int  # fp32 values per parameter kept whole (AdamW 2, SGD and Lion 1)
    factored: bool  # Adafactor's factored second moment besides them
    runtime: bool  # `strata train` runs it
    about: str


OPTIMIZERS: dict[str, Optimizer] = {o.name: o for o in (
    Optimizer("adamw", 2, False, True, "two fp32 moments; the default"),
    Optimizer("sgd", 1, False, False, "with momentum: one"),
    Optimizer("lion", 1, False, False, "one momentum"),
    Optimizer("adafactor", 0, True, False, "factored second moment: rows + columns per matrix"),
    Optimizer("adafactor-momentum", 1, True, False, "adafactor with a first moment"),
)}


def check_optimizer(name: str, planning: bool = True) -> Optimizer:
    """The table's entry; a name it lacks (or, for the trainer, one it does not run) is refused."""
    valid = [o.name for o in OPTIMIZERS.values() if planning or o.runtime]
    if name not in valid:
        described = ", ".join(f"{o} ({OPTIMIZERS[o].about})" for o in valid)
        raise ConfigError(f"valid: {described}", "optimizer", name)
    return OPTIMIZERS[name]


def factored_elements(shape: tuple[int, ...]) -> int:
    """Adafactor's second-moment values for one parameter: rows + columns of each matrix of the
    last two dimensions, the whole of a vector."""
    if len(shape) < 2:
        return math.prod(shape)
    return math.prod(shape[:-2]) * (shape[-2] + shape[-1])


def state_bytes(name: str, shapes: Iterable[tuple[int, ...]]) -> int:
    """Bytes of the optimizer's states for parameters of these shapes."""
    opt = OPTIMIZERS[name]
    total = 0
    for shape in shapes:
        total += opt.whole_moments * math.prod(shape) + (factored_elements(shape) if opt.factored else 0)
    return STATE_BYTES * total


def bytes_per_parameter(name: str, shapes: Iterable[tuple[int, ...]]) -> float:
    """The states' bytes over the parameters' count: what the planner charges each parameter a
    rank holds (exact for the whole model; a tensor-parallel shard of an (r, c) matrix factors into
    r/t + c, a little more than its share of r + c, which the rule leaves out)."""
    shapes = list(shapes)
    return state_bytes(name, shapes) / sum(math.prod(s) for s in shapes)
