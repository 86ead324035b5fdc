"""Splitting a backward pass into the input gradient (B) and the weight gradients (W), for the
zero-bubble schedules (Qi et al. 2024).

Nearly all of a transformer's weight-gradient work is in its linear layers (dW = gᵀx), so that is
where the split is made, as in the paper's Megatron implementation: while a chunk's forward runs
under `DeferWeightGrads`, every `F.linear` whose weight is a parameter goes through an autograd
function whose backward returns only the input gradient and leaves a closure that computes dW (and
the bias gradient) later, when the schedule's W action runs it. The model is not changed: the mode
intercepts the function call. Everything else (norm weights, embeddings) gets its gradient in B,
a few percent of the work."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode


class WeightGradStore:
    """Deferred weight-gradient closures, by the (micro-batch, chunk) whose backward made them."""

    def __init__(self):
        self.current = None  # set by the executor around a B action
        self.pending: dict[object, list] = defaultdict(list)

    def defer(self, work) -> None:
        self.pending[self.current].append(work)

    @torch.no_grad()
    def run(self, key) -> None:
        for work in self.pending.pop(key, []):
            work()


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)


class _LinearDeferredWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store):
        # Under autocast the matmuls run in its dtype; keep the input as the native linear would.
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        ctx.save_for_backward(x.to(dtype))
        # The parameters themselves, not saved tensors: a saved tensor comes back from saved-tensor
        # hooks (activation counting, sequence parallelism) as another object, whose .grad is not
        # the parameter's. A parameter on ctx makes no reference cycle.
        ctx.weight, ctx.bias, ctx.store, ctx.dtype = weight, bias, store, dtype
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        weight, bias, dtype = ctx.weight, ctx.bias, ctx.dtype
        grad_out = grad_out.to(dtype)

        def weight_grads():
            g2 = grad_out.reshape(-1, grad_out.shape[-1])
            _accumulate(weight, g2.t() @ x.reshape(-1, x.shape[-1]))
            if bias is not None:
                _accumulate(bias, g2.sum(0))

        ctx.store.defer(weight_grads)
        return grad_out @ weight.to(dtype), None, None, None


class DeferWeightGrads(TorchFunctionMode):
    """with DeferWeightGrads(store): forward  ->  its backward leaves dW for store.run(key)."""

    def __init__(self, store: WeightGradStore):
        super().__init__()
        self.store = store

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, weight, *rest = args
            bias = rest[0] if rest else kwargs.get("bias")
            # only leaf parameters: a slice of one (a replicated KV head) keeps autograd's path
            if isinstance(weight, nn.Parameter) and weight.requires_grad and \
                    (bias is None or isinstance(bias, nn.Parameter)):
                return _LinearDeferredWeight.apply(x, weight, bias, self.store)
        return func(*args, **kwargs)
