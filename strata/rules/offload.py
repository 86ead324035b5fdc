"""What ZeRO-Infinity moves between memory and its tiers in one step: the runtime's rule
(strata/parallel/zero3.py, strata/memory/offload.py), which the planner prices and the tests count.

With `--offload-params` each rank's fp32 shard elements Ψ (4 bytes each) and their gradients live
in a tier. Every micro-batch reads each unit's shard for its forward and again for its backward
(activation checkpointing's recomputation runs inside the backward, on the same read; a tied
embedding stays gathered from its forward to the head's backward, so it is read once), writes its
gradient shard, and from the second micro-batch on first reads the gradient accumulated so far;
the optimizer then reads shard and gradient and writes the shard. With `--offload disk` it also
reads and writes Adam's two moments (8 bytes). `--offload-activations` writes each checkpointed
block input once and reads it once, per micro-batch."""

from __future__ import annotations

from dataclasses import dataclass

MASTER_BYTES = 4  # fp32 shards and their gradients
MOMENT_BYTES = 8  # Adam's two fp32 moments


@dataclass(frozen=True)
class Traffic:
    """Bytes read from and written to a tier in one part of a step."""
    read: float = 0.0
    written: float = 0.0

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.read + other.read, self.written + other.written)


def parameter_traffic(shard_elements: float, micro_batches: int, kept_elements: float = 0.0) -> tuple[Traffic, Traffic]:
    """(forward and backward, the optimizer step) of the parameter tier. kept_elements: a unit
    that stays gathered from its forward to its backward (a tied embedding, which the head reads
    last) is read once per micro-batch."""
    m = micro_batches
    return (Traffic(MASTER_BYTES * (shard_elements * (2 * m + m - 1) - kept_elements * m), MASTER_BYTES * shard_elements * m),
            Traffic(2 * MASTER_BYTES * shard_elements, MASTER_BYTES * shard_elements))


def moment_traffic(shard_elements: float) -> Traffic:
    """The optimizer step's pass over Adam's moments on disk."""
    return Traffic(MOMENT_BYTES * shard_elements, MOMENT_BYTES * shard_elements)


def activation_traffic(bytes_per_micro_batch: float, micro_batches: int) -> Traffic:
    """Checkpointed block inputs: each written in the forward and read back in the backward."""
    return Traffic(bytes_per_micro_batch * micro_batches, bytes_per_micro_batch * micro_batches)
