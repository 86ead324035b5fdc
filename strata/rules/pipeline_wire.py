"""What a pipeline's messages travel in: the hidden states one stage sends the next and the
gradients sent back. One rule, read by the runtime (strata/train/trainer.py gives it to the
executor) and the planner (plan/cost.py prices a send with it).

Under mixed precision the messages travel in the compute dtype, as Megatron-LM sends them (its
p2p tensors are in params_dtype): half the bytes of the fp32 residual stream. That rounds the
hidden states to 16 bits at each cut, and their gradients on the way back; the receiving stage
computes on in its own dtype (strata/parallel/pipeline/executor.py). fp32 and fp64 runs send their
own dtype: nothing is cast. Names only (no torch import), as in rules/dtypes.py."""

from __future__ import annotations

from strata.rules.dtypes import DTYPES


def activation_wire(precision: str) -> str:
    """The dtype name a run of `precision` (a rules/dtypes.py name) sends between pipeline stages:
    bf16 for bf16, fp16 for fp16 (the loss scale keeps its gradients in range, and a gradient that
    overflows in the message makes the step skip as any other would), else the precision itself."""
    return DTYPES[precision].name  # the compute dtype: under mixed precision, its 16 bits


def activation_wire_bytes(precision: str) -> int:
    """Bytes per element of a pipeline message."""
    return DTYPES[activation_wire(precision)].bytes
