"""What every pipeline rank of one layout shares, worked out once per layout by the cost model
(strata/plan/cost.py `_terms`) and read by its time and memory halves (cost.py, rank_memory.py)."""

from __future__ import annotations

from dataclasses import dataclass

from strata.plan.compute import UnitSeconds
from strata.plan.context import NO_CONTEXT, ContextComm
from strata.plan.experts import NO_ALL_TO_ALL, AllToAll
from strata.plan.tensor import GridCost


@dataclass(frozen=True)
class Terms:
    """What every pipeline rank of a layout shares: sizes of one micro-batch, rates, message times."""
    act_bytes: int  # bytes per activation element
    precision: str  # mixed | fp32: how the model states are counted
    micro_batches: int  # per pipeline per step
    tokens: int  # per micro-batch on one rank: micro-batch x sequence / cp
    d_model: int
    peak: float  # FLOP/s of the device in the run's precision
    units: tuple[UnitSeconds, UnitSeconds, UnitSeconds]  # embedding, block, head: one micro-batch on one rank
    kernel_ceiling: float
    activation_per_layer: float  # bytes one block keeps for backward, per micro-batch
    tp_message: float  # bytes of one tensor-parallel collective
    pp_message: float  # bytes sent between stages per micro-batch (rules/pipeline_wire.py's dtype)
    pp_send_s: float
    tp_collective_s: float  # 1-D: one collective of tp_message
    grid: GridCost | None  # 2-D, 2.5-D, 3-D: bytes and seconds by part (plan/tensor.py)
    all_to_all: AllToAll = NO_ALL_TO_ALL  # a mixture's all-to-alls per MoE layer (plan/experts.py)
    moe_tp: tuple[float, float] = (0.0, 0.0)  # (seconds, bytes) an MoE layer adds to 1-D tp's collectives
    across: float = 0.0  # the all-to-all's time split over two nodes, over its time here (explain)
    context: ContextComm = NO_CONTEXT  # context parallelism's traffic per attention layer (plan/context.py)
    optimizer: str | float = "adamw"  # its name, or its state bytes per parameter of this model (Adafactor)
    tp_overlap: bool = False  # Workload.tp_overlap
