"""Defaults that the runtime, the planner and the docs must agree on, defined once."""

from __future__ import annotations

# Gradient bucket size of data parallelism and ZeRO-1/2 (--bucket-mb), as DDP's and DeepSpeed's default.
BUCKET_MB = 25.0

# Gradient reductions that may be in flight before the oldest is waited for, where each one holds
# memory of its own while in flight: ZeRO-2's staging buffers of full gradients (held:
# MAX_IN_FLIGHT + 1 of them, plan/cost.py counts them), ZeRO-0/1's copies of a bucket cast to the
# reduce dtype, ZeRO-3's staged unit gradients (zero3_hooks.py). Two keep the network busy while
# backward computes; more would only add such buffers. ZeRO-0/1 reducing their permanent gradient
# buffer in place hold nothing more, and are not throttled (rules/buckets.in_flight_limit).
MAX_IN_FLIGHT = 2

# Alignment of the flat buffers data parallelism and ZeRO-1/2 lay parameters and gradients out in
# (rules/buckets.py), in elements, as Megatron-Core's distributed optimizer pads its buffers
# (param_and_grad_buffer.py: each parameter's start to 64 elements, each bucket's end to
# lcm(dp, 128)): every parameter's view starts on a 128-byte boundary at 16 bits (256 at 32), as the
# fused optimizer's vectorised loads want, and every bucket on a 256-byte one, where NCCL's kernels
# move whole vectors and cuBLAS finds the weights (ZeRO-1/2 compute from views of the buffer) at the
# alignment its fastest GEMM algorithms need (Megatron aligns bucket starts after cuBLAS picked an
# algorithm incompatible with a misaligned weight). strata also pads a bucket to dp shards of whole
# PARAM_ALIGN_ELEMENTS, so every rank's shard (its reduce-scatter's output, its all-gather's input,
# its optimizer pieces) starts aligned too: at most 64 x dp elements more a bucket than Megatron's.
PARAM_ALIGN_ELEMENTS = 64
BUCKET_ALIGN_ELEMENTS = 128

# The fraction of a GPU's peak FLOP/s a training step's compute reaches when nothing is calibrated:
# between Megatron-LM's 175B (44%) and 1T (52%) A100 runs once communication and bubbles are priced
# separately (docs/cost-model.md).
DEFAULT_EFFICIENCY = 0.63

# The bytes of one chunk of the loss's fp32 logits, at most (strata/model/loss.py computes the loss a
# chunk of the sequence at a time; the planner prices one chunk): 256 MiB, where a 128K vocabulary's
# whole logits at 8K tokens would take 4 GiB. A chunk is at least one position.
LOGITS_CHUNK_BYTES = 256 * 2**20
