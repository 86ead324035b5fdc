"""DeepSeek's mixture of experts (DeepSeekMoE, Dai et al. 2024; DeepSeek-V2 and V3, DeepSeek-AI
2024): strata's MoE layer (strata/model/moe.py: stacked routed experts, the shared expert every
token goes through, expert and tensor parallelism as for any mixture) with DeepSeek's routing.

Per token, from the router's logits z (at least fp32):
  s = softmax(z) (V2) or sigmoid(z) (V3)                             the scores
  c = s (V2) or s + b (V3: b the experts' bias, which steers the choice only)
  group-limited: the n experts in G equal groups; a group's score is its best c (V2) or the sum of
  its two best (V3); only the topk_group best groups' experts may be chosen
  e = top-k of c;  w = s[e], over their sum when norm_topk (V3), times routed_scaling_factor
as transformers' DeepseekV2TopkRouter and DeepseekV3TopkRouter compute them.

V3's auxiliary-loss-free balancing (DeepSeek-V3 report, section 2.1.2): after each training step,
each expert's bias moves by gamma (`balance_rate`) towards the mean load: down when the expert took
more than the mean of the step's assignments, up when it took fewer; the loads are those of every
rank that routed tokens through the layer (the trainer sums them over the data-parallel group:
strata/train/trainer.py). The bias is a buffer (the router's e_score_correction_bias): no
gradient, no optimizer; checkpoints keep it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from strata.model.config import ModelConfig
from strata.model.moe import MoE, RouterLosses

SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Routing:
    scoring: str  # "softmax" (V2) or "sigmoid" (V3, with the experts' bias)
    groups: int  # n_group: 1 routes over every expert
    groups_kept: int  # topk_group: the groups a token's experts may come from
    scale: float  # routed_scaling_factor: the routed experts' weights times it
    balance_rate: float  # V3's bias step per training step (gamma); 0 keeps the bias as loaded


def check_routing(cfg: ModelConfig, routing: Routing) -> None:
    """ValueError naming the option a mixture cannot route by."""
    if routing.scoring not in SCORINGS:
        raise ValueError(f"family_options: scoring={routing.scoring!r} must be one of {', '.join(SCORINGS)}")
    n, g = cfg.n_experts, routing.groups
    if g < 1 or n % g:
        raise ValueError(f"family_options: groups={g} must divide n_experts={n}")
    if not 1 <= routing.groups_kept <= g or routing.groups_kept * (n // g) < cfg.experts_per_token:
        raise ValueError(f"family_options: groups_kept={routing.groups_kept} must be 1..groups={g}, its groups "
                         f"holding experts_per_token={cfg.experts_per_token} experts or more")
    if routing.scoring == "sigmoid" and g > 1 and n // g < 2:
        raise ValueError(f"family_options: groups={g}: V3's groups are scored by their two best experts, "
                         f"and each holds {n // g}")
    if routing.scoring == "softmax" and routing.balance_rate:
        raise ValueError("family_options: balance_rate is V3's bias step (scoring 'sigmoid')")
    if not 0 < routing.scale < float("inf") or not 0 <= routing.balance_rate < float("inf"):
        raise ValueError(f"family_options: scale={routing.scale!r} must be > 0 and balance_rate="
                         f"{routing.balance_rate!r} >= 0")


class DeepSeekMoE(MoE):
    def __init__(self, cfg: ModelConfig, losses: RouterLosses | None, routing: Routing):
        super().__init__(cfg, losses)
        self.routing = routing
        self.step_load: torch.Tensor | None = None  # assignments per expert over this step's micro-batches
        if routing.scoring == "sigmoid":  # on the router, under the name DeepSeek's files give it
            self.router.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_experts))

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        softmax = self.routing.scoring == "softmax"
        scores = F.softmax(logits, dim=-1) if softmax else torch.sigmoid(logits)
        choice = scores if softmax else scores + self.router.e_score_correction_bias.to(scores.dtype)
        groups = self.routing.groups
        if groups > 1:
            grouped = choice.view(choice.shape[0], groups, -1)
            group_scores = grouped.amax(-1) if softmax else grouped.topk(2, dim=-1).values.sum(-1)
            kept = torch.topk(group_scores, self.routing.groups_kept, dim=-1).indices
            allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            choice = choice.masked_fill(~allowed.unsqueeze(-1).expand_as(grouped).reshape_as(choice), float("-inf"))
        chosen = torch.topk(choice, self.k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        probs = scores if softmax else scores / scores.sum(-1, keepdim=True)  # the auxiliary loss's
        return weights * self.routing.scale, chosen, probs

    def routed(self, assigned: torch.Tensor) -> None:
        # a training forward's (not a recomputation's in backward), when the bias learns from them
        if self.routing.balance_rate and self.training and torch._C._current_graph_task_id() == -1:
            self.step_load = assigned.detach() if self.step_load is None else self.step_load + assigned.detach()


def balancing_layers(model: torch.nn.Module) -> list[DeepSeekMoE]:
    """The model's (or stage's) mixtures whose bias learns from their loads, in module order (the
    same on every rank holding them)."""
    return [m for m in model.modules() if isinstance(m, DeepSeekMoE) and m.routing.balance_rate]


@torch.no_grad()
def step_loads(layers: list[DeepSeekMoE], device: torch.device) -> torch.Tensor:
    """(layers, n_experts) assignments of this rank's step, in fp64 (exact counts), each layer's
    count cleared for the next step."""
    loads = torch.stack([m.step_load.double() if m.step_load is not None else
                         torch.zeros(m.n_experts, dtype=torch.float64, device=device) for m in layers])
    for m in layers:
        m.step_load = None
    return loads


@torch.no_grad()
def update_biases(layers: list[DeepSeekMoE], loads: torch.Tensor) -> None:
    """Each bias one step towards balance: + rate where an expert took fewer than the mean of the
    step's assignments (every rank's: `loads` summed), - rate where more, unchanged at the mean."""
    for layer, load in zip(layers, loads):
        step = torch.sign(load.mean() - load) * layer.routing.balance_rate
        bias = layer.router.e_score_correction_bias
        bias.add_(step.to(bias.dtype))
