"""1-bit Adam (--compress onebit): ZeRO-0's gradient all-reduce replaced, after --compress-after
warm-up steps of plain AdamW, by a 1-bit compressed average of Adam's momentum with error
feedback (Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
Convergence Speed", ICML 2021, as DeepSpeed's OnebitAdam runs it); the bytes:
strata/rules/compression.py `onebit_wire_bytes`.

Warm-up (steps 0 .. after-1): every rank's gradients all-reduced, then AdamW as torch computes it.
From step `after` on, Adam's second moment v is frozen (DeepSpeed's freeze_step) and per step:
  1. no gradient reduction: each rank's momentum takes its own gradient, m_r = b1 m + (1 - b1) g_r
     (g_r: this rank's gradient of its own rows' loss, dp times what backward left, which carries
     1/dp of the loss so that a plain reduction would sum to the average)
  2. worker side, on the flat momentum (the parameters end to end, padded to 8 dp elements) cut in
     dp chunks: c = m_r + e_w; its signs, and per piece k (a unit's part of a chunk: a unit is a
     tensor, or an embedding's row, rules/compression.onebit_units; or the padding:
     rules/compression.onebit_pieces) a scale s_k = ||c_k||_1 / n_k; the error
     e_w = c - s sign(c). The chunks go to their owners in one all-to-all (8 signs a byte, the
     chunk's scales' bytes after them).
  3. server side, chunk j on rank j: the dp decoded chunks averaged, x = average + e_s, compressed
     again (signs, a scale ||x_k||_1 / n_k per piece), e_s = x - s sign(x); the compressed chunks
     all-gathered.
  4. every rank decodes the same averaged momentum m, and updates with the frozen v, as AdamW
     does: p <- p (1 - lr wd) - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^after) + eps): the
     first moment's bias correction goes on with the step t, the second's stays at the step v
     was frozen.
The scale ||c||_1 / n (DeepSpeed: ||c||_2 / sqrt(n)) is the s that minimises ||c - s sign(c)||_2:
what error feedback carries to the next step is the least it can be. One bit has no zero: the
sign bit decides (copysign's rule: +0 is +1, -0 is -1); the padding is zero in m and both errors
(its piece's scale is 0). A scale per piece, not per chunk: a model's tensors' gradients differ by
hundreds of times, and one scale moves all of a chunk's elements by one amount (docs/benchmarks.md,
the compression paragraph). DeepSpeed's optimizers call compressed_allreduce once per parameter
tensor they are given: a worker scale per tensor, a server scale per tensor's chunk. An
embedding's rows each have a scale (its gradient is zero in the rows of the tokens a batch lacks:
with a scale per row they stay zero, where DeepSpeed asks for momentum masks).

Both collectives run at one point of every rank's step, inside the optimizer step (after
clipping), in a fixed order. Clipping and the reported gradient norm are each rank's own: the
norm of g_r (DeepSpeed clips the local gradients too). The momentum, v and the step are the
optimizer's state and go into checkpoints as AdamW's do; the two error buffers are this rank's
(`errors`, `load_errors`).

Beside a pipeline (synchronous schedules), each stage runs the rule in its optimizer step over its
own parameters and its own dp group: its flat buffer is the stage's parameters end to end, as a
dp-only run on a model made of that stage would hold them. A tied embedding's two copies (first
and last stage) get the sum of their gradients after the schedule, before the momentum takes them
(parallel/data.py `reduce_gradients`), and are a segment of their own on both stages: padded and
cut in dp chunks apart from the rest, row j of the collectives carrying every segment's chunk j
side by side. Cut with the rest, a copy's pieces would fall where its stage's chunk boundaries do,
which differ between the stages: different scales, copies drifting apart; apart, both stages
compute the same bits. The gradient norm is each rank's own, summed over the stages as the
pipeline sums it (the last stage's copy not counted twice).

0/1 Adam (--compress zeroone; Lu et al., "Maximizing Communication Efficiency for Large-scale
Training via 0/1 Adam", ICLR 2023, as DeepSpeed's ZeroOneAdam runs it before its var_freeze_step)
keeps v learning instead of freezing it: step t updates v where rules/compression.updates_variance
says (every step at first, then at spacings that double after each --var-update-scaler updates).
Such a step all-reduces the gradients whole and runs Adam on them: m and v both take the average g.
Any other step compresses the gradient, not the momentum: each rank's g_r, flat and padded, goes
through steps 2-3 above (its own worker and server errors), and m = b1 m + (1 - b1) (the decoded
average), v untouched. The update is AdamW's, m's bias correction with t, v's with the number of
updates v has had (so that the first --var-update-scaler steps are AdamW's exactly; DeepSpeed's
ZeroOneAdam corrects neither). Not built: DeepSpeed's var_freeze_step and the local steps after it
(its default, 100,000 steps, is past most runs, and its tutorial says to set it past the run)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.adamw import adamw

from strata.checkpoint.shards import RANK_STATE
from strata.distributed import comm
from strata.parallel.buckets import Bucket
from strata.parallel.gradients import Replicate
from strata.rules.compression import onebit_padded, onebit_rows, onebit_units, updates_variance, variance_updates

_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """8k values -> k bytes of their signs, the first value in the high bit; a bit is 1 where the
    sign bit is clear (+0 is positive)."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=values.device)
    return ((~torch.signbit(values)).view(-1, 8).to(torch.uint8) * weights).sum(1, dtype=torch.uint8)


def sign_table(like: torch.Tensor) -> torch.Tensor:
    """Byte -> its 8 signs as +-1 in `like`'s dtype: decoding is one gather, not 8 bit tests."""
    codes = torch.arange(256, device=like.device).unsqueeze(1)
    bits = codes.bitwise_and(torch.tensor(_BIT_WEIGHTS, device=like.device)).ne(0)
    return bits.to(like.dtype) * 2 - 1


def signed_scales(values: torch.Tensor, lengths: list[int], lengths_on_device: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat tensor cut in pieces of `lengths` -> (each piece's scale ||x||_1 / its length; each
    value as +-its piece's scale, by its sign bit)."""
    scales = torch.stack(torch._foreach_norm(values.split(lengths), 1)).div_(lengths_on_device)
    spread = torch.repeat_interleave(scales, lengths_on_device, output_size=values.numel())
    return scales, spread.copysign_(values)


class OnebitReplicate(Replicate):
    """ZeRO-0 for 1-bit Adam: gradients all-reduced during the warm-up only; after it, each rank
    keeps its own, and `average` of the momentum is the step's communication (0/1 Adam: of the
    gradient, on the steps that leave v alone). Holds the flat momentum (the optimizer's exp_avg
    are views of it), the two error buffers and, for 0/1 Adam, the flat gradient."""

    def __init__(self, params: list[nn.Parameter], settings, after: int, scaler: int = 0,
                 apart: nn.Parameter | None = None, embeddings: tuple[nn.Parameter, ...] = ()):
        """apart: a parameter that is a segment of its own (a tied embedding's copy beside a
        pipeline: the stages holding it cut it in chunks alike, so its copies stay identical).
        embeddings: parameters compressed a scale per row (rules/compression.onebit_units)."""
        super().__init__(params, settings)
        self.after, self.steps = after, 0  # steps: set by the optimizer, the one counter of the run's steps
        self.scaler = scaler  # 0/1 Adam's var_update_scaler (0: 1-bit Adam)
        dp, sample = self.dp_size, params[0]
        apart = apart if any(p is apart for p in params) else None
        segments = [s for s in ([apart], [p for p in params if p is not apart]) if s] if apart is not None else [params]
        # each segment padded on its own and cut in dp chunks; chunk j of the flat momentum (what
        # the collectives' row j carries) is every segment's chunk j, in order
        units = [[n for p in segment
                  for n in onebit_units(p.numel(), p.shape[-1] if any(p is e for e in embeddings) else None)]
                 for segment in segments]
        segment_pieces, self.scales = onebit_rows(units, dp)
        self.offsets, spans, flat_pieces, chunk_pieces, at = {}, [], [], [[] for _ in range(dp)], 0
        for segment, pieces in zip(segments, segment_pieces):
            sizes, start = [p.numel() for p in segment], at
            for p in segment:
                self.offsets[p], start = start, start + p.numel()
            padded = onebit_padded(sum(sizes), dp)
            spans.append((at, sum(sizes), padded))
            flat_pieces += [(j, len(chunk_pieces[j]) + k, n) for j in range(dp) for k, n in enumerate(pieces[j])]
            for j in range(dp):
                chunk_pieces[j] += pieces[j]
            at += padded
        self.elements = sum(p.numel() for p in params)
        self.spans = spans  # (start, elements, padded) of each segment in the flat momentum
        self.chunk = at // dp
        self.padding = [(start + n, start + padded) for start, n, padded in spans if padded > n]
        lo, self.own_padding, wire_at = self.dp_rank, [], 0  # this rank's chunk's padding, in its row
        for _, n, padded in spans:
            width = padded // dp
            if n - lo * width < width:
                self.own_padding.append((wire_at + max(n - lo * width, 0), wire_at + width))
            wire_at += width
        self.momentum = torch.zeros(at, dtype=sample.dtype, device=sample.device)
        # a scale per piece (a unit's part of a chunk, or a segment's padding): every piece's
        # length in the flat order, and its slot in the collectives' rows of `scales` (chunk j's
        # pieces in row j, in order; a chunk with fewer pieces pads its row: self.scales, onebit_rows)
        self.piece_lengths = [n for _, _, n in flat_pieces]
        self.lengths = torch.tensor(self.piece_lengths, device=sample.device)
        self.own_piece_lengths = chunk_pieces[self.dp_rank]
        self.own_lengths = torch.tensor(self.own_piece_lengths, device=sample.device)
        self.slots = torch.tensor([j * self.scales + k for j, k, _ in flat_pieces], device=sample.device)
        self.worker_error = torch.zeros_like(self.momentum)
        self.server_error = torch.zeros(self.chunk, dtype=sample.dtype, device=sample.device)
        self.table = sign_table(self.momentum)
        # 0/1 Adam: this rank's gradient, flat as the momentum, averaged compressed in place
        self.gradient = torch.zeros_like(self.momentum) if scaler else None

    @property
    def compressing(self) -> bool:
        """Whether this step's gradients stay unreduced (the step about to run is steps + 1)."""
        if self.scaler:
            return self.group is not None and not updates_variance(self.steps + 1, self.scaler)
        return self.group is not None and self.steps >= self.after

    def momentum_of(self, param: nn.Parameter) -> torch.Tensor:
        return self._view(self.momentum, param)

    def gradient_of(self, param: nn.Parameter) -> torch.Tensor:
        return self._view(self.gradient, param)

    def _view(self, flat: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
        at = self.offsets[param]
        return flat[at:at + param.numel()].view_as(param)

    # --- backward: after the warm-up, nothing to reduce ---------------------------------------------
    def _start(self, bucket: Bucket):
        if self.compressing:
            return None  # the gradient stays this rank's; the momentum travels in the optimizer step
        return super()._start(bucket)

    def _finish(self, bucket: Bucket) -> None:
        if not self.compressing:
            super()._finish(bucket)

    def grad_norm_pairs(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """After the warm-up, the norms of this rank's own gradient g_r (dp x what backward left)."""
        pairs = super().grad_norm_pairs()
        return [(norm * self.dp_size, p) for norm, p in pairs] if self.compressing else pairs

    # --- the compressed average ---------------------------------------------------------------------
    @torch.no_grad()
    def average(self, flat: torch.Tensor) -> None:
        """Every rank's `flat` (the momentum, or 0/1 Adam's gradient) -> their compressed average, the
        same on every rank, in place."""
        dp, chunk = self.dp_size, self.chunk
        corrected = self.worker_error.add_(flat)  # c = m + e_w, in e_w's buffer
        scales, compressed = signed_scales(corrected, self.piece_lengths, self.lengths)
        rows = torch.zeros(dp * self.scales, dtype=scales.dtype, device=scales.device).index_copy_(0, self.slots, scales)
        signs = [pack_signs(part.view(dp, -1)).view(dp, -1) for part in self._segments(corrected)]
        received = self._exchange(comm.all_to_all, signs, rows.view(dp, self.scales))
        corrected.sub_(compressed)  # e_w = c - s sign(c)
        for lo, hi in self.padding:
            self.worker_error[lo:hi] = 0
        # rank j serves chunk j: the dp ranks' rows all carry its pieces' scales
        own = received[:, chunk // 8:].contiguous().view(self.momentum.dtype)[:, :len(self.own_lengths)]
        spread = torch.repeat_interleave(own, self.own_lengths, dim=1, output_size=chunk)
        served = self._signs(received[:, :chunk // 8], torch.empty(dp, chunk, dtype=self.momentum.dtype,
                                                                   device=flat.device))
        served = served.mul_(spread).sum(0).div_(dp).add_(self.server_error)
        for lo, hi in self.own_padding:  # the padding of this rank's chunk stays zero
            served[lo:hi] = 0
        server_scales, compressed = signed_scales(served, self.own_piece_lengths, self.own_lengths)
        row = torch.zeros(self.scales, dtype=scales.dtype, device=scales.device)
        row[:len(self.own_lengths)] = server_scales
        gathered = self._exchange(comm.all_gather, [pack_signs(served).view(1, -1)], row.view(1, self.scales))
        self.server_error.copy_(served - compressed)
        # every chunk's pieces' scales, in the flat order, spread over their elements
        scales = gathered[:, chunk // 8:].contiguous().view(self.momentum.dtype).view(-1).index_select(0, self.slots)
        spread = torch.repeat_interleave(scales, self.lengths, output_size=flat.numel())
        at = 0
        for part in self._segments(flat):
            width = part.numel() // dp
            self._signs(gathered[:, at // 8:(at + width) // 8], part.view(dp, width))
            at += width
        flat.mul_(spread)
        for lo, hi in self.padding:
            flat[lo:hi] = 0

    def _segments(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """`flat`'s segments, each padded (its rows: its chunks)."""
        return [flat[start:start + padded] for start, _, padded in self.spans]

    def _exchange(self, collective, signs: list[torch.Tensor], scales: torch.Tensor) -> torch.Tensor:
        """Rows of packed signs (each segment's, a row's parts side by side), each row's scales'
        bytes after them, through `collective`: dp such rows out."""
        wire = torch.cat([*signs, scales.view(torch.uint8)], dim=1)
        out = torch.empty(self.dp_size, wire.shape[1], dtype=torch.uint8, device=wire.device)
        collective(out, wire, self.group, self.group_name)
        return out

    def _signs(self, packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Rows of packed signs -> `out`'s rows of +-1 (out contiguous)."""
        return torch.index_select(self.table, 0, packed.reshape(-1).int(), out=out.view(-1, 8)).view_as(out)

    # --- the state beside the optimizer's -----------------------------------------------------------
    def errors(self) -> dict[str, torch.Tensor]:
        return {"worker_error": self.worker_error, "server_error": self.server_error}

    def load_errors(self, saved: dict[str, torch.Tensor]) -> None:
        for name, tensor in self.errors().items():
            tensor.copy_(saved[name].view_as(tensor))

    def _grads_bytes(self) -> int:
        held = [*self.errors().values(), *([self.gradient] if self.gradient is not None else [])]
        return super()._grads_bytes() + sum(t.numel() * t.element_size() for t in held)


class OnebitAdam(torch.optim.Optimizer):
    """AdamW for the warm-up, then 1-bit Adam (the module's rule) over `strategy`'s compressed
    average. Its state per parameter is AdamW's: step, exp_avg (a view of the strategy's flat
    momentum), exp_avg_sq (v, frozen after the warm-up)."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], strategy: OnebitReplicate,
                 eps: float = 1e-8):
        super().__init__(groups, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        self.strategy = strategy

    @torch.no_grad()
    def step(self, closure=None):
        strategy = self.strategy
        compressing, t = strategy.compressing, strategy.steps + 1
        groups = [(group, list(group["params"])) for group in self.param_groups]
        for group, params in groups:
            for p in params:
                self._state(p)
        if strategy.scaler:
            self._zeroone_step(groups, compressing, t)
            strategy.steps = t
            return
        if not compressing:  # the warm-up: torch's AdamW (fused), on the all-reduced gradients
            for group, params in groups:
                (b1, b2), states = group["betas"], [self.state[p] for p in params]
                adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                      [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], fused=True, amsgrad=False,
                      beta1=b1, beta2=b2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                      maximize=False)
            strategy.steps = t
            return
        for group, params in groups:  # 1: each rank's momentum takes its own gradient
            b1, momenta = group["betas"][0], [self.state[p]["exp_avg"] for p in params]
            torch._foreach_mul_(momenta, b1)
            torch._foreach_add_(momenta, [p.grad for p in params], alpha=(1 - b1) * strategy.dp_size)
        strategy.average(strategy.momentum)  # 2, 3
        for group, params in groups:  # 4: AdamW's update with v frozen
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
        """0/1 Adam's step t (the module's rule): the average gradient whole (v updated) or compressed."""
        strategy = self.strategy
        if compressing:  # this rank's g_r (dp x what backward left), averaged through the 1-bit collectives
            params = [p for _, ps in groups for p in ps]
            torch._foreach_copy_([strategy.gradient_of(p) for p in params], [p.grad for p in params])
            strategy.gradient.mul_(strategy.dp_size)
            strategy.average(strategy.gradient)
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

    def _state(self, p: nn.Parameter) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)  # on it: the fused kernel's
            state["exp_avg"] = self.strategy.momentum_of(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        return state

    def state_dict(self) -> dict:
        """AdamW's state, and this rank's own: its two error buffers (checkpoints write them in
        this rank's file: strata/checkpoint/shards.py RANK_STATE)."""
        return {**super().state_dict(), RANK_STATE: self.strategy.errors()}

    def load_state_dict(self, state_dict: dict) -> None:
        """AdamW's state, with exp_avg put back into the strategy's flat momentum, and the step
        count (which says whether the warm-up is over) handed to the strategy; the errors this rank
        saved, when they fit (the same dp: else they start at zero, as after the warm-up)."""
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
                    view = self.strategy.momentum_of(p)
                    view.copy_(state["exp_avg"])
                    state["exp_avg"] = view
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
                    self.strategy.steps = int(state["step"])
