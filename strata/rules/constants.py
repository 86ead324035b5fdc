"""Defaults that the runtime, the planner and the docs must agree on, defined once."""

from __future__ import annotations

# Gradient bucket size of data parallelism and ZeRO-1/2 (--bucket-mb), as DDP's and DeepSpeed's default.
BUCKET_MB = 25.0

# Gradient buckets whose reduction may be in flight before the oldest is waited for (ZeRO-0..2's
# reductions and ZeRO-1/2's gathers). Two keep the network busy while backward computes; more
# would only add the backend's temporary buffers (gloo copies each message) and, under ZeRO-2,
# staging buffers of full gradients (held: MAX_IN_FLIGHT + 1 of them, plan/cost.py counts them).
MAX_IN_FLIGHT = 2

# The fraction of a GPU's peak FLOP/s a training step's compute reaches when nothing is calibrated:
# between Megatron-LM's 175B (44%) and 1T (52%) A100 runs once communication and bubbles are priced
# separately (docs/cost-model.md).
DEFAULT_EFFICIENCY = 0.63
