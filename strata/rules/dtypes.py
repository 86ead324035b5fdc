"""The dtypes a run can compute in, and what each means for the runtime, the planner and the CLI.

bf16 and fp16 are mixed precision: fp32 master weights, gradients and optimizer states, the
matmuls under autocast in 16 bits (fp16 with loss scaling). fp32 and fp64 compute in their own
dtype. Names only here (no torch import): `torch_dtype` turns a name into torch's dtype."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str
    torch_name: str  # the attribute of torch
    bytes: int  # per element of activations and 16/32/64-bit tensors
    autocast: bool  # mixed precision: fp32 masters, compute in this dtype under autocast


DTYPES: dict[str, DType] = {
    "fp32": DType("fp32", "float32", 4, False),
    "fp64": DType("fp64", "float64", 8, False),
    "bf16": DType("bf16", "bfloat16", 2, True),
    "fp16": DType("fp16", "float16", 2, True),
}


def torch_dtype(name: str):
    """torch's dtype for a name ('bf16' -> torch.bfloat16)."""
    import torch  # only where a tensor is made: the rules stay importable without torch
    return getattr(torch, DTYPES[name].torch_name)


def parameter_dtype(name: str):
    """The dtype a run's parameters (master weights) are held in: fp32 under mixed precision."""
    return torch_dtype("fp32" if DTYPES[name].autocast else name)
