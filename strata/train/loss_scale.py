"""Dynamic loss scaling for fp16 (Micikevicius et al., "Mixed Precision Training", 2018).

fp16 holds nothing above 65504 and flushes gradients below ~6e-8 to zero, so the loss is multiplied
by a scale S before backward (small gradients move into range) and the gradients divided by S
before the optimizer. When any gradient on any rank is inf or NaN the step is skipped, on every
rank alike (the check is one all-reduce of a flag over all ranks), and S is halved; after
`growth_interval` good steps in a row S is doubled. bf16 has fp32's range and needs none of this.

Gradients that overflow even at the smallest scale (`min_scale`, 1 by default, as DeepSpeed's) are
not a transient: the loss itself is inf or NaN. Training stops then rather than skipping every
step to the end (and saving the untrained weights as if all were well)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from strata.distributed import comm


class LossScaler:
    def __init__(self, init_scale: float, growth_interval: int, device: torch.device,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, min_scale: float = 1.0):
        self.scale, self.min_scale = float(init_scale), float(min_scale)
        self.growth_interval, self.growth_factor, self.backoff_factor = growth_interval, growth_factor, backoff_factor
        self.good_steps = 0
        self.skipped_steps = 0
        self.device = device

    def unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Divide this rank's gradients by the scale in place; True when every rank's are finite."""
        found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
        if grads:
            inv_scale = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=self.device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        if dist.is_initialized() and dist.get_world_size() > 1:  # gradients are split across ranks
            comm.all_reduce(found_inf, None, "world", op=dist.ReduceOp.MAX)
        return found_inf.item() == 0

    def update(self, finite: bool) -> None:
        if not finite:
            if self.scale <= self.min_scale:
                raise FloatingPointError(f"the gradients overflow even at the smallest loss scale "
                                         f"({self.min_scale:g}) after {self.skipped_steps + 1} skipped steps; "
                                         f"stopped (lower --lr, or use bf16/fp32)")
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps, self.skipped_steps = state["scale"], state["good_steps"], state["skipped_steps"]
