"""Tensor parallelism's norms over a whole projection's output (OLMo 2's q and k norms, whose mean
runs over every head's features, while each rank computes a slice of the heads): the placements
projection_norm and kv_projection_norm of strata/model/families/base.py, applied by
strata/parallel/tensor.py."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from strata.parallel import tensor_comm as tpc


class ProjectionNorm(nn.Module):
    """RMSNorm over the whole output of a column-parallel projection, of which this rank holds a
    slice of the features: the sum of squares is summed over the group forward and backward (each
    rank's features' share of its gradient is a part of the whole), the weight split as the
    features are (`spec`: its ShardSpec, dimension 0). one_plus: Gemma's (1 + w) scaling."""

    def __init__(self, full_width: int, eps: float, one_plus: bool, group, spec):
        super().__init__()
        self.full_width, self.eps, self.one_plus, self.group = full_width, eps, one_plus, group
        self.weight = nn.Parameter(torch.empty(full_width // dist.get_world_size(group)))
        self.tp_specs = {"weight": spec}

    def forward(self, x):
        compute = torch.promote_types(x.dtype, torch.float32)
        h = x.to(compute)
        # all-reduced forward (copy_to_tp: identity) and backward (reduce_from_tp: identity)
        squares = tpc.reduce_from_tp(tpc.copy_to_tp(h.pow(2).sum(-1, keepdim=True), self.group), self.group)
        h = h * torch.rsqrt(squares / self.full_width + self.eps)
        weight = self.weight.to(compute)
        return (h * (1.0 + weight if self.one_plus else weight)).to(x.dtype)


def keep_rows_after(norm: nn.Module, rows: slice) -> None:
    """A norm kept whole over a K computed whole (fewer KV heads than ranks): after it, this rank
    keeps the features of its query heads' KV heads (`kept_rows`, which the KV cache reads too)."""
    norm.kept_rows = rows
    norm.register_forward_hook(lambda module, args, out: out[..., module.kept_rows])
