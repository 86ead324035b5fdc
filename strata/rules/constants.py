"""Defaults that the runtime, the planner and the docs must agree on, defined once."""

from __future__ import annotations

# Gradient bucket size of data parallelism and ZeRO-1/2 (--bucket-mb), as DDP's and DeepSpeed's default.
BUCKET_MB = 25.0

# The fraction of a GPU's peak FLOP/s a training step's compute reaches when nothing is calibrated:
# between Megatron-LM's 175B (44%) and 1T (52%) A100 runs once communication and bubbles are priced
# separately (docs/cost-model.md).
DEFAULT_EFFICIENCY = 0.63
