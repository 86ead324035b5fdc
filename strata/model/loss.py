"""The loss of the last hidden states in chunks of the sequence, so that the whole logits never exist.

The head's logits, upcast to fp32 for the softmax, are tokens x vocabulary x 4 bytes: 4 GiB for
8K tokens of a 128K vocabulary, and as much again for their gradient. Computed chunk by chunk
(torchtune's and Liger-Kernel's chunked cross-entropy), only one chunk's logits are alive at a
time: the forward keeps nothing of a chunk but its loss, and the backward computes each chunk's
logits again (one more head matmul, as activation checkpointing does for a block) and turns them
into the chunk's gradients at once. The mean over tokens is the unchunked one; only the order of
the sums changes. The head weight's gradient is summed over the chunks in place (a linear head's:
`SumLinearWeightGrads`), so it is one weight-sized tensor, as unchunked.

What it costs: the head's forward matmul once more; under tensor parallelism the vocabulary-parallel
loss's all-reduces (3 numbers a token) once more; a grid head (tensor_nd.py) gathers its weight
block for every chunk, three times (forward, recomputation, backward) instead of twice a micro-batch.

What a chunk runs is the model's own head and criterion, whatever they are (one device, the
vocabulary-parallel loss of tensor parallelism, the grid heads of tensor_nd.py): `project` maps
hidden states to logits, `criterion.token_losses` logits and targets to each token's loss, and
`criterion.mean` the summed losses to the mean (over the ranks too where a grid splits the
sequences). The head module's own hooks (ZeRO-3 gathers its unit before it and frees it after,
and gathers it again before its backward) fire once around all the chunks, as around one call."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from strata.rules.constants import LOGITS_CHUNK_BYTES

# A model whose whole logits fit in one chunk (rules/constants.LOGITS_CHUNK_BYTES, which the planner
# prices too) computes its loss unchunked, keeping its logits for backward. Tests and the GPU check
# set this module's LOGITS_CHUNK_BYTES to try other budgets.


def chunk_bounds(rows: int, positions: int, width: int, budget: int | None = None) -> list[tuple[int, int]] | None:
    """[start, end) of each chunk of the `positions` sequence positions, so that rows x chunk x
    width fp32 logits fit in `budget` bytes (LOGITS_CHUNK_BYTES when None); None when one chunk
    holds them all. Every rank of a tensor-parallel group must cut alike: rows, positions and width
    (this rank's logits columns) are equal across it."""
    budget = LOGITS_CHUNK_BYTES if budget is None else budget
    per_chunk = max(1, budget // (4 * rows * width))
    if per_chunk >= positions:
        return None
    return [(start, min(start + per_chunk, positions)) for start in range(0, positions, per_chunk)]


class _ChunkedLosses(torch.autograd.Function):
    """The sum of every token's loss, chunk by chunk of dimension 1 (the sequence); no chunk's
    logits are kept: backward computes them again, one chunk at a time, and returns the gradients
    of the hidden states and of the weights `project` reads (summed over the chunks)."""

    @staticmethod
    def forward(ctx, losses_of, bounds, h, targets, *weights):
        device = h.device.type
        ctx.losses_of, ctx.bounds, ctx.weights = losses_of, bounds, weights  # parameters on ctx, as zero_bubble.py
        # backward runs outside the forward's autocast: it recomputes under the same one
        ctx.autocast = dict(device_type=device, dtype=torch.get_autocast_dtype(device),
                            enabled=torch.is_autocast_enabled(device))
        ctx.save_for_backward(h, targets)
        total = None
        for start, end in bounds:
            part = losses_of(h[:, start:end], targets[:, start:end]).sum()
            total = part if total is None else total + part
        return total

    @staticmethod
    def backward(ctx, grad_total):
        h, targets = ctx.saved_tensors
        wanted = [w for i, w in enumerate(ctx.weights) if ctx.needs_input_grad[4 + i]]
        sums = WeightGradSums(wanted)
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[2] else None
        for start, end in ctx.bounds:
            part = h.detach()[:, start:end].requires_grad_()
            with torch.enable_grad(), torch.autocast(**ctx.autocast), SumLinearWeightGrads(sums):
                total = ctx.losses_of(part, targets[:, start:end]).sum()
            grads = torch.autograd.grad(total, [part, *wanted], grad_total, allow_unused=True)
            if grad_h is not None:
                grad_h[:, start:end] = grads[0]
            for weight, grad in zip(wanted, grads[1:]):
                if grad is not None:  # a head other than a plain linear layer's (the grid's)
                    sums.add(weight, grad)
        return None, None, grad_h, None, *(sums.of(w) for w in ctx.weights)


class WeightGradSums:
    """Each weight's gradient summed over the chunks, in the weight's dtype."""

    def __init__(self, weights):
        self.sums = {id(w): None for w in weights}

    def holds(self, weight) -> bool:
        return weight is None or id(weight) in self.sums

    def of(self, weight) -> torch.Tensor | None:
        return self.sums.get(id(weight))

    def add(self, weight, grad: torch.Tensor) -> None:
        total = self.sums[id(weight)]
        self.sums[id(weight)] = grad.to(weight.dtype) if total is None else total.add_(grad)

    def add_product(self, weight, grad_out: torch.Tensor, x: torch.Tensor) -> None:
        """Add grad_outᵀ x, the gradient of a linear layer's weight: in place when the dtypes
        agree, so that no second weight-sized tensor is made (under autocast the product is in
        its dtype, half the size, as the unchunked backward makes it)."""
        total = self.sums[id(weight)]
        if total is not None and total.dtype == grad_out.dtype:
            total.addmm_(grad_out.t(), x)
        else:
            self.add(weight, grad_out.t() @ x)


class _LinearSummingWeightGrads(torch.autograd.Function):
    """F.linear whose backward adds the weight's (and bias's) gradient into `sums` in place and
    returns only the input's."""

    @staticmethod
    def forward(ctx, x, weight, bias, sums):
        # under autocast the matmuls run in its dtype (zero_bubble.py's _LinearDeferredWeight)
        device = x.device.type
        ctx.dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        ctx.save_for_backward(x.to(ctx.dtype))
        ctx.weight, ctx.bias, ctx.sums = weight, bias, sums
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        grad_out = grad_out.to(ctx.dtype)
        flat = grad_out.reshape(-1, grad_out.shape[-1])
        ctx.sums.add_product(ctx.weight, flat, x.reshape(-1, x.shape[-1]))
        if ctx.bias is not None:
            ctx.sums.add(ctx.bias, flat.sum(0))
        return grad_out @ ctx.weight.to(ctx.dtype), None, None, None


class SumLinearWeightGrads(TorchFunctionMode):
    """While a chunk's logits are recomputed: F.linear on weights `sums` holds adds their gradients
    into the sums in place; without it each chunk's gradient of the head's weight would be a
    weight-sized tensor beside the running sum (2 GiB each for a 128K x 4096 fp32 head)."""

    def __init__(self, sums: WeightGradSums):
        super().__init__()
        self.sums = sums

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            given = {**dict(zip(("input", "weight", "bias"), args)), **kwargs}
            weight, bias = given["weight"], given.get("bias")
            if self.sums.holds(weight) and weight is not None and self.sums.holds(bias):
                return _LinearSummingWeightGrads.apply(given["input"], weight, bias, self.sums)
        return func(*args, **kwargs)


def call_as_forward(module: nn.Module, function, *args):
    """`function(*args)` run as one call of `module`: the module's forward and backward hooks fire
    around it, once."""
    own = module.__dict__.get("forward")  # a forward already wrapped on the instance
    module.forward = function
    try:
        return module(*args)
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def chunked_loss(h: torch.Tensor, targets: torch.Tensor, head: nn.Module | None, project, criterion,
                 weights: list[torch.Tensor], bounds: list[tuple[int, int]]) -> torch.Tensor:
    """The criterion's mean loss of `project(h)`, computed chunk by chunk of `bounds` along the
    sequence. h: (batch, seq, features), the final norm's output; weights: every parameter
    `project` reads; head: the module whose hooks fire around the chunks (None: no module, a tied
    matrix read directly)."""
    def losses_of(part, part_targets):
        return criterion.token_losses(project(part), part_targets)

    def total_of(h, targets):
        return _ChunkedLosses.apply(losses_of, bounds, h, targets, *weights)

    total = total_of(h, targets) if head is None else call_as_forward(head, total_of, h, targets)
    return criterion.mean(total, targets)
