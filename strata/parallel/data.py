"""Data parallelism, plain form: every rank holds the whole model, starts from the same weights
and averages its gradients with the others before the optimizer step.

All gradients travel in one flat buffer per dtype (one all-reduce instead of one per tensor)."""

from __future__ import annotations

import torch
from torch import nn

from strata.distributed import comm


@torch.no_grad()
def broadcast_parameters(model: nn.Module, group) -> None:
    """Copy rank 0's parameters to every rank of the group, so all replicas start identical."""
    params = [p for p in model.parameters()]
    flat = torch.cat([p.reshape(-1) for p in params])
    comm.broadcast(flat, 0, group, "dp")
    offset = 0
    for p in params:
        p.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


@torch.no_grad()
def average_gradients(model: nn.Module, group, world_size: int) -> None:
    """Average the gradients over the group: sum by all-reduce, then divide."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group, "dp")
    flat.div_(world_size)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
