"""A mixture-of-experts MLP (Shazeer et al. 2017; Switch, Fedus et al. 2021; Mixtral, Jiang et al.
2024; Qwen2-MoE): a router scores each token against every expert, the token goes through its k
best, and their outputs are summed, weighted by the router's probabilities.

Written for one device, like every layer here. The experts' matrices are stacked, (n_experts, out,
in) per projection, so that expert parallelism splits them along the first dimension and the
checkpoint keeps one logical tensor per projection whatever the layout. What moves tokens to the
experts and back is `self.dispatch` (strata/parallel/expert.py replaces it with all-to-all over
the expert-parallel group); here every expert is local.

The routing, per token (in at least fp32, as transformers' routers compute it):
  p = softmax(x Wr^T)                     over all n_experts
  (w, e) = top-k of p                     w renormalised to sum to 1 when norm_topk
  y = sum_j w_j expert_{e_j}(x)  (+ the shared expert, times sigmoid(x g^T) when gated)
Dropless by default. With a capacity factor c, expert e takes at most ceil(c * T * k / n_experts)
of the micro-batch's T tokens, in token order (Switch); a token over capacity skips that expert
(its residual passes) and is counted as dropped.

The load-balancing loss (Switch's form, as Mixtral's `load_balancing_loss_func` computes it over
one layer): n_experts * sum_e f_e * P_e, f_e the fraction of the k*T assignments routed to e
(before drops) times k, P_e the mean router probability of e. The block's value is averaged over
the layers and weighted by router_aux_coef. Its gradient is added in the layer's backward (the
way Megatron-core's MoEAuxLossAutoScaler does), so a pipeline stage needs no extra output: the
trainer sets `RouterLosses.grad_scale` to the factor it multiplies the language-model loss by."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from strata.model.config import ModelConfig
from strata.model.grouped_experts import grouped_applies, grouped_experts, loop_experts, padded_applies, padded_experts


@dataclass
class RouterLosses:
    """Shared by a model's MoE layers: the factor the auxiliary loss's gradient is scaled by (the
    trainer's, for the language-model loss: accumulation, data parallelism, fp16's loss scale),
    and what the layers route, per forward, for the metrics."""
    n_layers: int
    coef: float
    grad_scale: float = 1.0
    aux: list[torch.Tensor] = field(default_factory=list)  # per layer forward: its (unweighted) loss
    load: list[torch.Tensor] = field(default_factory=list)  # per layer forward: tokens per expert
    dropped: list[torch.Tensor] = field(default_factory=list)  # per layer forward: assignments dropped

    def take(self) -> dict[str, torch.Tensor]:
        """What the forwards since the last take routed: the weighted aux loss summed (a micro-batch's
        mean over layers, summed over micro-batches), tokens per expert and dropped assignments summed."""
        out = {"aux_loss": torch.stack(self.aux).sum() * self.coef / self.n_layers if self.aux else None,
               "expert_load": torch.stack(self.load).sum(0) if self.load else None,
               "dropped": torch.stack(self.dropped).sum() if self.dropped else None}
        self.aux, self.load, self.dropped = [], [], []
        return out


class _AddAuxGradient(torch.autograd.Function):
    """Identity on the layer's output; in backward, the auxiliary loss gets the gradient `scale`
    (d(total loss)/d(aux) times what the trainer multiplies the loss by)."""

    @staticmethod
    def forward(ctx, output, aux, scale):
        ctx.scale = scale
        ctx.aux_dtype = aux.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


def _identity(x):
    return x


class Experts(nn.Module):
    """n SwiGLU experts with stacked weights: w_gate, w_up (n, d_ff, d_model), w_down (n, d_model, d_ff)."""

    # each matrix's d_ff dimension, which tensor parallelism splits (dimension 0 is the expert's)
    d_ff_dims = {"w_gate": 1, "w_up": 1, "w_down": 2}

    def __init__(self, n: int, d_model: int, d_ff: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(n, d_ff, d_model))
        self.w_up = nn.Parameter(torch.empty(n, d_ff, d_model))
        self.w_down = nn.Parameter(torch.empty(n, d_model, d_ff))

    def forward(self, x: torch.Tensor, counts: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
        """x: rows sorted by expert, counts[i] (on the device) of them for local expert i; sizes: the
        same as read by the caller already, or None. The form (strata/model/grouped_experts.py):
        torch's grouped product where it has a kernel (bf16 on an H100, fp32 on a CPU), which reads
        nothing; else the counts are read here unless the caller has (the layer's one read), for
        batched products over padded rows on a GPU, for the per-expert loop on a CPU (faster there).
        An expert without rows computes on none: the output stays in the graph of x and of the weights
        even when every expert here is idle, so that backward still runs the exchange that brought x
        (expert parallelism: the other ranks wait for it) and the weights get their zero gradient."""
        weights = (self.w_gate, self.w_up, self.w_down)
        if grouped_applies(x, *weights):
            return grouped_experts(x, counts, *weights)
        sizes = sizes if sizes is not None else counts.tolist()
        if padded_applies(x, sizes):
            return padded_experts(x, counts, max(sizes, default=0), *weights)
        return loop_experts(x, sizes, *weights)


def local_dispatch(experts: Experts, x: torch.Tensor, counts: torch.Tensor,
                   sizes: list[int] | None = None) -> torch.Tensor:
    """Every expert on this device: compute the sorted rows in place (sizes: counts as read by the
    caller already, if it has)."""
    return experts(x, counts, sizes)


def _per_expert(index: torch.Tensor, n: int) -> torch.Tensor:
    """How many of `index`'s entries name each of 0..n-1: bincount's answer, whose output size the
    host need not read (bincount's depends on the largest value)."""
    return torch.zeros(n, dtype=torch.long, device=index.device).scatter_add_(0, index, torch.ones_like(index))


class SharedExpert(nn.Module):
    """The expert every token goes through (Qwen2-MoE's shared_expert, DeepSeek's shared experts)."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_ff, bias=False)
        self.w_up = nn.Linear(d_model, d_ff, bias=False)
        self.w_down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, losses: RouterLosses):
        super().__init__()
        self.n_experts, self.k, self.norm_topk = cfg.n_experts, cfg.experts_per_token, cfg.norm_topk
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.d_model, cfg.expert_width)
        self.shared = SharedExpert(cfg.d_model, cfg.shared_d_ff) if cfg.shared_d_ff else None
        self.shared_gate = nn.Linear(cfg.d_model, 1, bias=False) if cfg.gated_shared_expert else None
        self.losses = losses
        self.capacity_factor: float | None = None  # None: dropless (the trainer's --capacity-factor)
        self.dispatch = local_dispatch
        # Under tensor parallelism (strata/parallel/tensor.py; identities on one device): the routing
        # weights pass through `whole_gradient` (the tp ranks' partial gradients summed), the routed
        # experts' partial outputs through `reduce_partial`, and what the router and the shared gate
        # read through `replicated_input` (each rank's copy of their input gradient counted 1/t).
        self.whole_gradient = self.reduce_partial = self.replicated_input = _identity

    # The routing's shapes depend on the data (rows per expert, drops) and its records on Python
    # state: compiled, it would recompile as the routing changes; --compile compiles the rest of
    # the block around it.
    @torch.compiler.disable
    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        tokens = x.shape[0]
        compute = torch.promote_types(x.dtype, torch.float32)  # fp64 training stays fp64
        whole = self.replicated_input(x)
        weights, chosen, probs = self.route(self.router(whole).to(compute))
        flat_expert = chosen.reshape(-1)
        assigned = _per_expert(flat_expert, self.n_experts)
        self.routed(assigned)
        aux = self.n_experts * (assigned.to(compute) / tokens * probs.mean(0)).sum()
        keep = self._within_capacity(chosen, tokens)
        # Assignments (token, slot) sorted by expert, stable so that each expert sees its tokens in
        # order; dropped ones (key n_experts) sort last and are cut off once the kept count is read.
        # No boolean mask and no bincount: the layer reads the device at most once, for the rows per
        # expert (dropless, where the experts run torch's grouped product, not at all).
        keys = flat_expert if keep is None else torch.where(keep, flat_expert, self.n_experts)
        slots = torch.argsort(keys, stable=True)
        counts, sizes = assigned, None
        if keep is not None:
            counts = _per_expert(keys, self.n_experts + 1)[:-1]
            sizes = counts.tolist()
            slots = slots[:sum(sizes)]
        token_of = slots // self.k
        routed = self.dispatch(self.experts, x[token_of], counts, sizes)
        w = self.whole_gradient(weights.to(x.dtype)).reshape(-1)[slots]
        out = self.reduce_partial(torch.zeros_like(x).index_add_(0, token_of, routed * w[:, None]))
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(whole)) * shared
            out = out + shared
        if self.training and torch._C._current_graph_task_id() == -1:  # not a recomputation in backward
            self.losses.aux.append(aux.detach())
            self.losses.load.append(assigned.detach())
            self.losses.dropped.append(torch.full((), tokens * self.k - slots.numel(), device=x.device))
        if self.training and self.losses.coef and torch.is_grad_enabled():
            out = _AddAuxGradient.apply(out, aux, self.losses.grad_scale * self.losses.coef / self.losses.n_layers)
        return out.reshape(shape)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the weights of each token's k experts, the experts (T, k), the probabilities the
        auxiliary loss averages (T, n_experts)) from the router's logits: softmax, top-k (a family's
        mixture may route otherwise: strata/model/deepseek_moe.py)."""
        probs = F.softmax(logits, dim=-1)
        weights, chosen = torch.topk(probs, self.k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, chosen, probs

    def routed(self, assigned: torch.Tensor) -> None:
        """Told the micro-batch's assignments per expert (a mixture that balances by them keeps them)."""

    def _within_capacity(self, chosen: torch.Tensor, tokens: int) -> torch.Tensor | None:
        """Which of the T*k assignments (token-major) fit their expert's capacity; None when dropless."""
        if self.capacity_factor is None:
            return None
        capacity = math.ceil(self.capacity_factor * tokens * self.k / self.n_experts)
        flat = chosen.reshape(-1, 1)  # one-hot by scatter: F.one_hot reads the ids' range on some devices
        one_hot = torch.zeros(flat.shape[0], self.n_experts, dtype=torch.long, device=flat.device).scatter_(1, flat, 1)
        position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # the assignment's place in its expert's queue
        return position < capacity
