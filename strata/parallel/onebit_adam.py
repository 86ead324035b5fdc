"""1-bit Adam (--compress onebit): the data-parallel gradient reduction replaced, after
--compress-after warm-up steps of plain AdamW, by a 1-bit compressed average of Adam's momentum
with error feedback (Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with
Adam's Convergence Speed", ICML 2021, as DeepSpeed's OnebitAdam runs it); the bytes:
strata/rules/compression.py `onebit_wire_bytes`. Under ZeRO-0 (`OnebitReplicate`) or ZeRO-1
(`OnebitShardStates`).

Warm-up (steps 0 .. after-1): the ZeRO stage's own reduction and AdamW as torch computes it.
From step `after` on, Adam's second moment v is frozen (DeepSpeed's freeze_step) and per step:
  1. no gradient reduction: each rank's momentum takes its own gradient, m_r = b1 m + (1 - b1) g_r
     (g_r: this rank's gradient of its own rows' loss, dp times what backward left, which carries
     1/dp of the loss so that a plain reduction would sum to the average)
  2-3. m_r averaged through the 1-bit all-to-all and all-gather, with the worker's and the
     server's errors (strata/parallel/onebit_average.py): every rank holds the same averaged m.
  4. the update, as AdamW's with the frozen v: p <- p (1 - lr wd) - lr / (1 - b1^t) * m /
     (sqrt(v) / sqrt(1 - b2^after) + eps): the first moment's bias correction goes on with the step
     t, the second's stays at the step v was frozen.

ZeRO-1 shards v and the update, not the compression: m stays whole on every rank (step 1 needs it:
each rank's own gradient goes into all of it), and the averaged m is whole on every rank after step
3. Each rank updates its ZeRO-1 shard with its shard of v, and ZeRO-1's all-gather of the updated
parameters follows, uncompressed: 4Ψ(N-1)/N bytes a step (fp32) beside the two 1-bit rounds'
about 2Ψ/8 (N-1)/N. So it saves memory (v, and under 0/1 Adam m, 1/N each), not bytes: ZeRO-0
sends less. The warm-up's
AdamW updates this rank's shard of m only; the first compressed step of a process (after the
warm-up, or after a resume) all-gathers m once (`_whole_momentum`). DeepSpeed runs its 1-bit
optimizers without ZeRO.

Both collectives run at one point of every rank's step, inside the optimizer step (after
clipping), in a fixed order. Clipping and the reported gradient norm are each rank's own: the
norm of g_r, whole (DeepSpeed clips the local gradients too); ZeRO-1's norm is then not summed
over the dp ranks (`grads_partitioned`). The momentum, v and the step are the optimizer's state and
go into checkpoints as AdamW's do; the two error buffers are this rank's (`errors`, `load_errors`).

Beside a pipeline (synchronous schedules), each stage runs the rule in its optimizer step over its
own parameters and its own dp group: its flat buffer is the stage's parameters end to end, as a
dp-only run on a model made of that stage would hold them. A tied embedding's two copies (first
and last stage) get the sum of their gradients after the schedule, before the momentum takes them
(parallel/data.py `reduce_gradients`), and are a segment of their own on both stages
(onebit_average.py), so both stages compute the same bits. The gradient norm is each rank's own,
summed over the stages as the pipeline sums it (the last stage's copy not counted twice).

0/1 Adam (--compress zeroone; Lu et al., "Maximizing Communication Efficiency for Large-scale
Training via 0/1 Adam", ICLR 2023, as DeepSpeed's ZeroOneAdam runs it before its var_freeze_step)
keeps v learning instead of freezing it: step t updates v where rules/compression.updates_variance
says (every step at first, then at spacings that double after each --var-update-scaler updates).
Such a step reduces the gradients as the ZeRO stage does and runs Adam on them: m and v both take
the average g. Any other step compresses the gradient, not the momentum: each rank's g_r, flat and
padded, goes through steps 2-3 above (its own worker and server errors), and m = b1 m + (1 - b1)
(the decoded average), v untouched; under ZeRO-1, on this rank's shard of m only. The update is
AdamW's, m's bias correction with t, v's with the number of updates v has had (so that the first
--var-update-scaler steps are AdamW's exactly; DeepSpeed's ZeroOneAdam corrects neither). Not
built: DeepSpeed's var_freeze_step and the local steps after it (its default, 100,000 steps, is
past most runs, and its tutorial says to set it past the run)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.adamw import adamw

from strata.checkpoint.shards import RANK_STATE
from strata.distributed import comm
from strata.parallel.buckets import Bucket
from strata.parallel.gradients import Replicate, ShardOptimizerStates
from strata.parallel.onebit_average import OnebitAverage
from strata.parallel.sharding import pair_norms, tensor_bytes
from strata.rules.compression import updates_variance, variance_updates


class _Compressed:
    """What ZeRO-0's and ZeRO-1's 1-bit strategies add to their stage: no reduction in backward on
    the compressed steps, each rank's own gradient for the norm and clipping then, and the flat
    buffers the optimizer's compressed average runs on."""

    def _set_up(self, after: int, scaler: int, apart: nn.Parameter | None, embeddings: tuple[nn.Parameter, ...],
                whole_momentum: bool) -> None:
        """whole_momentum: the optimizer's exp_avg are views of one flat momentum, whole on every rank."""
        self.after, self.steps = after, 0  # steps: set by the optimizer, the one counter of the run's steps
        self.scaler = scaler  # 0/1 Adam's var_update_scaler (0: 1-bit Adam)
        self.averager = OnebitAverage(self.params, self.group, self.group_name, self.dp_size, self.dp_rank, apart,
                                     embeddings)
        self.momentum = self.averager.zeros() if whole_momentum else None
        # 0/1 Adam: this rank's gradient, flat in the same layout, averaged compressed in place
        self.gradient = self.averager.zeros() if scaler else None
        self._optimized: dict[int, tuple[nn.Parameter, int, int]] = {}  # optimizer tensor -> its parameter's range
        self.momentum_whole_after: int | None = None  # the step after which every rank's m is known whole

    @property
    def compressing(self) -> bool:
        """Whether this step's gradients stay unreduced (the step about to run is steps + 1)."""
        if self.scaler:
            return self.group is not None and not updates_variance(self.steps + 1, self.scaler)
        return self.group is not None and self.steps >= self.after

    @property
    def grads_partitioned(self) -> bool:
        return super().grads_partitioned and not self.compressing

    def momentum_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The flat momentum's part that an optimizer tensor (a parameter, or its ZeRO-1 piece) updates."""
        return self._part(self.momentum, tensor)

    def gradient_of(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._part(self.gradient, tensor)

    def _part(self, flat: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        if not self._optimized:
            self._optimized = {id(t): (p, lo, hi) for t, p, lo, hi in self.optimizer_pieces()}
        param, lo, hi = self._optimized[id(tensor)]
        return self.averager.view(flat, param) if tensor is param else self.averager.view(flat, param, lo, hi)

    def local_momenta(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """1-bit Adam's step 1: (the whole momentum, a view per parameter; this rank's own
        gradients of them). The step's average leaves m whole and equal on every rank."""
        if self.momentum_whole_after != self.steps:
            self._whole_momentum()
        self.momentum_whole_after = self.steps + 1
        return [self.averager.view(self.momentum, p) for p in self.params], [p.grad for p in self.params]

    def local_gradient(self) -> torch.Tensor:
        """0/1 Adam's compressed step: this rank's own gradient g_r (dp x what backward left), flat."""
        torch._foreach_copy_([self.averager.view(self.gradient, p) for p in self.params], [p.grad for p in self.params])
        return self.gradient.mul_(self.dp_size)

    def loaded(self, step: int) -> None:
        """A checkpoint's state is in: its step count says whether the warm-up is over; a ZeRO-1
        momentum is this rank's shard only until gathered."""
        self.steps, self.momentum_whole_after = step, None

    def _whole_momentum(self) -> None:
        """Every rank's momentum whole and equal (ZeRO-0's always is; ZeRO-1 gathers it)."""

    # --- backward: on a compressed step, nothing to reduce ------------------------------------------
    def _start(self, bucket: Bucket):
        if self.compressing:
            return None  # the gradient stays this rank's; the momentum travels in the optimizer step
        return super()._start(bucket)

    def _finish(self, bucket: Bucket) -> None:
        if not self.compressing:
            super()._finish(bucket)

    def grad_pairs(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """On a compressed step, this rank's own gradients, whole (ZeRO-1's shards of them hold no
        reduction): what clipping scales and the momentum takes."""
        if self.compressing:
            return [(p.grad, p) for p in self.params if p.grad is not None]
        return super().grad_pairs()

    def grad_norm_pairs(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """On a compressed step, the norms of this rank's own gradient g_r (dp x what backward left)."""
        pairs = pair_norms(self.grad_pairs())
        return [(norm * self.dp_size, p) for norm, p in pairs] if self.compressing else pairs

    # --- the state beside the optimizer's -----------------------------------------------------------
    def errors(self) -> dict[str, torch.Tensor]:
        return self.averager.errors()

    def load_errors(self, saved: dict[str, torch.Tensor]) -> None:
        self.averager.load_errors(saved)

    def _compression_bytes(self) -> int:
        """The error buffers, and 0/1 Adam's flat gradient."""
        return tensor_bytes([*self.errors().values(), *([self.gradient] if self.gradient is not None else [])])


class OnebitReplicate(_Compressed, Replicate):
    """ZeRO-0 for 1-bit and 0/1 Adam: gradients all-reduced on the steps that are not compressed;
    on the others each rank keeps its own and the optimizer's compressed average is the step's
    communication. The optimizer's exp_avg are views of the flat momentum."""

    def __init__(self, params: list[nn.Parameter], settings, after: int, scaler: int = 0,
                 apart: nn.Parameter | None = None, embeddings: tuple[nn.Parameter, ...] = ()):
        super().__init__(params, settings)
        self._set_up(after, scaler, apart, embeddings, whole_momentum=True)

    def _grads_bytes(self) -> int:
        return super()._grads_bytes() + self._compression_bytes()


class OnebitShardStates(_Compressed, ShardOptimizerStates):
    """ZeRO-1 for 1-bit and 0/1 Adam: the optimizer updates this rank's shard (v's, and the
    parameters'), ZeRO-1's all-gather of the parameters follows every step. 1-bit Adam keeps the
    momentum whole (a flat buffer the optimizer's exp_avg are views of); 0/1 Adam's m is sharded
    as v is (its compressed average is of the gradient)."""

    def __init__(self, params: list[nn.Parameter], settings, after: int, scaler: int = 0,
                 apart: nn.Parameter | None = None, embeddings: tuple[nn.Parameter, ...] = ()):
        super().__init__(params, settings)
        self._set_up(after, scaler, apart, embeddings, whole_momentum=not scaler)

    def _whole_momentum(self) -> None:
        """The warm-up's AdamW updated this rank's shard of m only; a process's first compressed
        step (after the warm-up, or after a resume) needs every rank's m whole and equal: each
        bucket's shards all-gathered once, through a buffer of one bucket in the gradient
        buffer's layout."""
        for bucket in self.buckets:
            staging = torch.zeros(bucket.size, dtype=self.momentum.dtype, device=self.momentum.device)
            views = [(self.averager.view(self.momentum, p).view(-1), offset - bucket.start)
                     for p, offset in zip(bucket.params, bucket.offsets)]
            for view, at in views:
                staging[at:at + view.numel()] = view
            lo, hi = bucket.shard(self.dp_rank, self.dp_size)
            comm.all_gather(staging, staging[lo - bucket.start:hi - bucket.start], self.group, self.group_name)
            for view, at in views:
                view.copy_(staging[at:at + view.numel()])

    def _grads_bytes(self) -> int:
        """ZeRO-1's, the compression's buffers, and 1-bit Adam's whole momentum beyond the shard
        the optimizer's state counts."""
        beyond = 0
        if self.momentum is not None:
            beyond = tensor_bytes([self.momentum]) - sum(hi - lo for _, _, lo, hi in self.optimizer_pieces()) \
                * self.momentum.element_size()
        return super()._grads_bytes() + self._compression_bytes() + beyond


class OnebitAdam(torch.optim.Optimizer):
    """AdamW for the warm-up, then 1-bit Adam (the module's rule) over `strategy`'s compressed
    average. Its state per tensor it updates (a parameter, or its ZeRO-1 piece) is AdamW's: step,
    exp_avg (a view of the strategy's flat momentum; 0/1 Adam under ZeRO-1: its own), exp_avg_sq
    (v, frozen after 1-bit Adam's warm-up)."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], strategy: _Compressed,
                 eps: float = 1e-8):
        super().__init__(groups, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        self.strategy = strategy

    @torch.no_grad()
    def step(self, closure=None):
        strategy = self.strategy
        compressing, t = strategy.compressing, strategy.steps + 1
        # (a ZeRO-1 rank's shard may hold no piece of a group's tensors)
        groups = [(group, list(group["params"])) for group in self.param_groups if group["params"]]
        for group, params in groups:
            for p in params:
                self._state(p)
        if strategy.scaler:
            self._zeroone_step(groups, compressing, t)
            strategy.steps = t
            return
        if not compressing:  # the warm-up: torch's AdamW (fused), on the reduced gradients
            for group, params in groups:
                (b1, b2), states = group["betas"], [self.state[p] for p in params]
                adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                      [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], fused=True, amsgrad=False,
                      beta1=b1, beta2=b2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                      maximize=False)
            strategy.steps = t
            return
        b1 = self.param_groups[0]["betas"][0]  # 1: each rank's momentum, whole, takes its own gradient
        momenta, grads = strategy.local_momenta()
        torch._foreach_mul_(momenta, b1)
        torch._foreach_add_(momenta, grads, alpha=(1 - b1) * strategy.dp_size)
        strategy.averager.average(strategy.momentum)  # 2, 3
        for group, params in groups:  # 4: AdamW's update with v frozen, of what this rank updates
            lr, (b1, b2), eps, states = group["lr"], group["betas"], group["eps"], [self.state[p] for p in params]
            root = math.sqrt(1 - b2 ** strategy.after)  # v's bias correction stops where v does
            # m / (sqrt(v) / root + eps) = m root / (sqrt(v) + eps root)
            denominators = torch._foreach_sqrt([s["exp_avg_sq"] for s in states])
            torch._foreach_add_(denominators, eps * root)
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            torch._foreach_addcdiv_(params, [s["exp_avg"] for s in states], denominators,
                                    value=-lr / (1 - b1 ** t) * root)
            for state in states:
                state["step"].fill_(t)
        strategy.steps = t

    def _zeroone_step(self, groups: list, compressing: bool, t: int) -> None:
        """0/1 Adam's step t (the module's rule): the average gradient reduced (v updated) or compressed."""
        strategy = self.strategy
        if compressing:  # this rank's g_r, averaged through the 1-bit collectives
            strategy.averager.average(strategy.local_gradient())
        updates = variance_updates(t, strategy.scaler)  # v's, this step's included
        for group, params in groups:
            lr, (b1, b2), eps, states = group["lr"], group["betas"], group["eps"], [self.state[p] for p in params]
            grads = [strategy.gradient_of(p) for p in params] if compressing else [p.grad for p in params]
            momenta, variances = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
            torch._foreach_mul_(momenta, b1)
            torch._foreach_add_(momenta, grads, alpha=1 - b1)
            if not compressing:
                torch._foreach_mul_(variances, b2)
                torch._foreach_addcmul_(variances, grads, grads, value=1 - b2)
            root = math.sqrt(1 - b2 ** updates)  # m / (sqrt(v) / root + eps) = m root / (sqrt(v) + eps root)
            denominators = torch._foreach_sqrt(variances)
            torch._foreach_add_(denominators, eps * root)
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            torch._foreach_addcdiv_(params, momenta, denominators, value=-lr / (1 - b1 ** t) * root)
            for state in states:
                state["step"].fill_(t)

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)  # on it: the fused kernel's
            state["exp_avg"] = self.strategy.momentum_of(p) if self.strategy.momentum is not None else torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        return state

    def state_dict(self) -> dict:
        """AdamW's state, and this rank's own: its two error buffers (checkpoints write them in
        this rank's file: strata/checkpoint/shards.py RANK_STATE)."""
        return {**super().state_dict(), RANK_STATE: self.strategy.errors()}

    def load_state_dict(self, state_dict: dict) -> None:
        """AdamW's state, with exp_avg put back into the strategy's flat momentum (where it has
        one), and the step count (which says whether the warm-up is over) handed to the strategy;
        the errors this rank saved, when they fit (the same dp: else they start at zero, as after
        the warm-up)."""
        state_dict = dict(state_dict)
        errors = state_dict.pop(RANK_STATE, {})
        sizes = {name: t.numel() for name, t in self.strategy.errors().items()}
        if {name: t.numel() for name, t in errors.items()} == sizes:
            self.strategy.load_errors(errors)
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if state:
                    if self.strategy.momentum is not None:
                        view = self.strategy.momentum_of(p)
                        view.copy_(state["exp_avg"])
                        state["exp_avg"] = view
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
                    self.strategy.loaded(int(state["step"]))
