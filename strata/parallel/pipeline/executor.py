"""The one executor that runs every pipeline schedule.

A schedule (strata/rules/schedules.py) gives each rank its ordered list of actions.
This runs them on the rank's chunks; communication follows from each action:
  F(i, c)  chunk 0 reads micro-batch i's tokens; a later chunk receives its input from chunk c-1.
           The output goes to chunk c+1; the last chunk computes the loss (scaled by 1/m, so the
           accumulated gradient is the batch mean, as on one process).
  B(i, c)  the last chunk starts from its loss; an earlier one receives the output gradient from
           chunk c+1. The input gradient goes to chunk c-1.
  W(i, c)  zero-bubble only: the weight gradients B left for later.
Messages travel on the pipeline's links (distributed/mesh.PipelineLinks): one process group per
direction and kind between two stages, carrying one stream of messages posted and received in the
same order, as NCCL needs (it runs a group's operations one at a time, matches them without tags,
and a send waits for its receive). A send is posted without waiting, right after the action that
made it, and waited for only when the pipeline drains; a receive is posted and waited for when
its action needs it, and nothing else is waited for. Shapes are known ahead (micro-batch,
sequence or its 1/tp slice, d_model), so no shapes are exchanged, and so is the dtype messages
travel in (the wire: strata/rules/pipeline_wire.py, 16 bits under mixed precision). A stage
computes in its own dtype, its weights' (the fp32 masters under autocast, whose residual stream is
fp32; bf16 weights gathered by ZeRO, whose stream is bf16); the hidden states are rounded to the
wire when sent and widened to the receiving stage's dtype, and their gradients likewise on the way
back: the single-process run with that rounding at each cut (tests/test_pipeline_bf16.py). (Where
autocast makes a stage's output wider than its weights, as CUDA's fp32 LayerNorm on the embedding
does to bf16 weights, the next stage still goes on in its weights' dtype.) An output whose send
has completed keeps no storage (Megatron's trick: backward needs only its autograd node, not its
values); its node and saved activations go once its backward has run.

The asynchronous schedules run through `segment` instead of `step`: one step's part of a pipeline
that does not flush between steps, each action computing with its step's weight version
(versions.py), the forwards run ahead for later steps left in flight to the next call.

Each action's compute time is recorded (the timeline: CUDA events on a GPU, read once the step's
compute stream has finished; the host clock on a CPU), from which the step's idle fraction per rank
is measured, and the bytes a chunk's forward saves for backward are counted (on its first forward;
the shapes never change), so the peak activation memory of the schedule is measured, not
estimated."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from strata.distributed import comm
from strata.distributed.mesh import PipelineLinks
from strata.distributed.timing import DeviceClock, synchronize_stream
from strata.memory.activations import count_saved_activations
from strata.parallel.pipeline.versions import WeightVersions
from strata.parallel.pipeline.zero_bubble import DeferWeightGrads, WeightGradStore
from strata.rules.pipeline_cut import PipelineLayout
from strata.rules.schedules import SCHEDULES, Action, Message, build, messages, segment

GROUP = "pp"


@dataclass
class Timed:
    action: Action
    start: float  # seconds since the step began (after a barrier of the pipeline group)
    end: float


def _backward(output: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward from `output`, whose values may have been freed after sending: the engine call
    that torch.autograd.backward makes, without its check that grad's shape matches the (now
    empty) output's. Megatron-LM's custom_backward does the same."""
    torch.autograd.Variable._execution_engine.run_backward(
        (output,), (grad,), False, False, (), True, True)  # keep_graph, create_graph, inputs, unreachable, accumulate


def stage_dtype(chunks: dict[int, nn.Module], default: torch.dtype) -> torch.dtype:
    """The dtype a stage computes its hidden states in: its weights' (fp32 masters under autocast,
    bf16 when ZeRO gathers bf16 weights, fp64); `default` for a stage without weights."""
    return next((p.dtype for chunk in chunks.values() for p in chunk.parameters() if p.is_floating_point()), default)


class PipelineExecutor:
    def __init__(self, chunks: dict[int, nn.Module], layout: PipelineLayout, schedule: str, group,
                 links: PipelineLinks, activation_shape: tuple[int, ...], wire_dtype: torch.dtype,
                 device: torch.device, autocast=contextlib.nullcontext, model_states: nn.Module | None = None,
                 versions: WeightVersions | None = None):
        self.chunks, self.layout, self.schedule, self.group = chunks, layout, schedule, group
        self.links = links
        self.shape, self.wire_dtype, self.device, self.autocast = activation_shape, wire_dtype, device, autocast
        self.stage_dtype = stage_dtype(chunks, wire_dtype)  # what received hidden states are widened to
        self.model_states = model_states  # its parameters are not activations
        self.versions = versions  # asynchronous schedules: this stage's weight versions
        self.rank = dist.get_rank(group)
        self.clock = DeviceClock(device)
        self.last_chunk = layout.num_chunks - 1
        self.store = WeightGradStore() if SCHEDULES[schedule].splits_backward else None
        self.timeline: list[Timed] = []
        self.saved_bytes: dict[int, int] = {}  # chunk -> bytes one micro-batch's forward saves
        self._idle: float | tuple[float, torch.Tensor] = 0.0  # see idle_fraction
        self.loss_scale = 1.0  # fp16: the trainer's dynamic loss scale, times 1/dp (the average over data-parallel ranks)
        self.peak_activation_bytes = 0

    # --- one training step ----------------------------------------------------------------------
    def step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of every micro-batch through the pipeline; gradients accumulate in
        the parameters' .grad. Returns the sum of the micro-batches' losses on the rank holding the
        last chunk, 0 elsewhere."""
        m = len(micro_batches)
        actions = build(self.schedule, self.layout.stages, m, self.layout.virtual_stages)[self.rank]
        self._begin()
        comm.barrier(self.group, GROUP)  # a common start, so the ranks' timelines line up
        loss_sum = self._run(actions, lambda k: micro_batches[k], m, step=0)
        self._wait_sends()
        self._measure_idle()
        return loss_sum

    def segment(self, micro_batch, m: int, step: int, fill: bool, stop: int) -> torch.Tensor:
        """Asynchronous schedules: this rank's part of step `step` of the flushless 1F1B
        (strata/rules/schedules.segment), each action computing with the weight version its step
        uses. micro_batch(k): micro-batch k of the stream (step k // m); the forwards that run ahead
        belong to later steps and stay in flight to the next call; none starts at `stop` or later
        (the pipeline drains when that is the next step's first). No barrier and no collective: the
        ranks meet only through the activations they pass. Returns the sum of step `step`'s losses
        on the last stage's rank, 0 elsewhere."""
        drain = stop == (step + 1) * m
        if fill:
            self._begin()
            self.held, self.live, self.peak = {}, 0, 0
            self.previous_end = None
        actions = segment(self.layout.stages, m, self.rank, step, fill, stop)
        loss_sum = self._run(actions, micro_batch, m, step)
        if drain:
            self._wait_sends()
        self._measure_idle_locally()
        return loss_sum

    def _run(self, actions: list[Action], micro_batch, m: int, step: int) -> torch.Tensor:
        """Run this rank's actions: micro_batch(k) gives micro-batch k's (inputs, targets)."""
        self.timeline = []
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.versions is None:  # a step holds its own micro-batches only
            self.held, self.live, self.peak = {}, 0, 0
        releases = "W" if self.store is not None else "B"
        marks = []  # (action, start, end) in the device clock's marks
        self.t0_host, t0 = time.perf_counter(), self.clock.mark()
        for action in actions:
            key = (action.microbatch, action.chunk)
            if self.versions is not None:  # weight stashing: forward and backward see the step's version
                self.versions.use_step(action.microbatch // m)
            if action.kind == "F":
                x = self._input(action, micro_batch)
                start = self.clock.mark()
                loss, self.held[key] = self._forward(action, x, micro_batch, m)
                if loss is not None and action.microbatch // m == step:
                    loss_sum += loss.double()
                self.live += self.held[key]
                self.peak = max(self.peak, self.live)
            elif action.kind == "B":
                grad = self._output_grad(action)
                start = self.clock.mark()
                self._backward(action, grad)
            else:
                start = self.clock.mark()
                self.store.run(key)
            if action.kind == releases:
                self.live -= self.held.pop(key)
            marks.append((action, start, self.clock.mark()))
            self._free_sent()
        if self.versions is not None:
            self.versions.use_masters()
        self.peak_activation_bytes = self.peak
        synchronize_stream(self.device)  # the compute stream only: run-ahead sends may stay in flight
        self.timeline = [Timed(action, self.clock.seconds(t0, start), self.clock.seconds(t0, end))
                         for action, start, end in marks]
        return loss_sum

    def _begin(self) -> None:
        """A pipeline run from empty."""
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.sending: list[tuple[comm._Pending, torch.Tensor | None]] = []  # posted: (handle, output to free)

    def _messages(self, action: Action) -> tuple[Message | None, Message | None]:
        return messages(action, self.layout.stages, self.layout.num_chunks)

    def _input(self, action: Action, micro_batch) -> torch.Tensor:
        incoming, _ = self._messages(action)
        if incoming is None:  # chunk 0, its own copy: a view would keep (and count) the whole batch
            return micro_batch(action.microbatch)[0].to(self.device, copy=True)
        # widened to the stage's dtype (no copy when the wire is that dtype): the leaf whose
        # gradient goes back, in the stage's dtype as on one process
        return self._receive(incoming).to(self.stage_dtype).requires_grad_(torch.is_grad_enabled())

    def _forward(self, action: Action, x, micro_batch, m: int):
        """Run chunk c on micro-batch i; returns (its unscaled loss or None, bytes saved for backward)."""
        i, c = action.microbatch, action.chunk
        last = c == self.last_chunk
        targets = micro_batch(i)[1].to(self.device) if last else None
        defer = DeferWeightGrads(self.store) if self.store is not None and torch.is_grad_enabled() else \
            contextlib.nullcontext()
        # Every micro-batch has the same shapes, so a chunk saves the same bytes each time: count
        # them on its first forward only (saved-tensor hooks cost a few percent of the step).
        count = c not in self.saved_bytes and torch.is_grad_enabled()
        exclude = (self.model_states,) if self.model_states is not None else ()
        with count_saved_activations(*exclude) if count else contextlib.nullcontext() as saved, \
                self.autocast(), defer:
            out = self.chunks[c](x, targets)
        if count:
            self.saved_bytes[c] = saved.bytes
        if last:
            loss = out.detach()
            out = out * (self.loss_scale / m)
        else:
            loss = None
            if not out.is_floating_point() or tuple(out.shape) != self.shape:
                raise RuntimeError(f"pipeline chunk {c} produced {tuple(out.shape)} {out.dtype}; the receiving "
                                   f"stage expects {self.shape} hidden states (sent in {self.wire_dtype})")
            self._send(self._messages(action)[1], out.detach().to(self.wire_dtype),
                       out if torch.is_grad_enabled() else None)
        if torch.is_grad_enabled():
            self.inputs[(i, c)], self.outputs[(i, c)] = x, out
        return loss, self.saved_bytes.get(c, 0)

    def _output_grad(self, action: Action) -> torch.Tensor:
        incoming, _ = self._messages(action)
        if incoming is None:  # the last chunk starts from its loss
            return torch.ones((), dtype=self.outputs[(action.microbatch, action.chunk)].dtype, device=self.device)
        return self._receive(incoming)

    def _backward(self, action: Action, grad: torch.Tensor) -> None:
        key = (action.microbatch, action.chunk)
        x, out = self.inputs.pop(key), self.outputs.pop(key)
        if self.store is not None:
            self.store.current = key
        _backward(out, grad.to(out.dtype))  # it came in the wire's dtype: widened to the output's
        _, outgoing = self._messages(action)
        if outgoing is not None:
            self._send(outgoing, x.grad.to(self.wire_dtype), None)

    # --- communication --------------------------------------------------------------------------
    def _send(self, message: Message, tensor: torch.Tensor, output: torch.Tensor | None) -> None:
        """Post a message on its link, without waiting; `output`, once sent, gives up its storage."""
        link = self.links.group(message.kind, message.sender, message.receiver)
        handle = comm.send_recv([(tensor.contiguous(), self.links.peers[message.receiver])], [], link, GROUP)
        self.sending.append((handle, output))

    def _receive(self, message: Message) -> torch.Tensor:
        """Post the receive of a message on its link, and wait for it (only it)."""
        buffer = torch.empty(self.shape, dtype=self.wire_dtype, device=self.device)
        link = self.links.group(message.kind, message.sender, message.receiver)
        comm.send_recv([], [(buffer, self.links.peers[message.sender])], link, GROUP).wait()
        self._free_sent()
        return buffer

    def _free_sent(self) -> None:
        """Outputs whose send has completed give up their storage (their autograd node stays)."""
        still = []
        for handle, output in self.sending:
            if handle.is_completed():
                handle.wait()
                if output is not None:
                    output.data = torch.empty(0, dtype=output.dtype, device=output.device)
            else:
                still.append((handle, output))
        self.sending = still

    def _wait_sends(self) -> None:
        for handle, _ in self.sending:
            handle.wait()
        self.sending = []

    # --- measurements ---------------------------------------------------------------------------
    def _measure_idle_locally(self) -> None:
        """Asynchronous schedules, without a collective: 1 - compute time / the time since this
        rank's previous segment ended (from its start, after a fill), the steady-state idle fraction."""
        busy = sum(t.end - t.start for t in self.timeline)
        end = time.perf_counter()
        span = end - (self.previous_end if self.previous_end is not None else self.t0_host)
        self.previous_end = end
        self._idle = 1 - busy / span if span > 0 else 0.0

    def _measure_idle(self) -> None:
        """Idle fraction of this rank over the step: 1 - compute time / the slowest rank's span."""
        busy = sum(t.end - t.start for t in self.timeline)
        # filled on the device (a tensor of a Python list would be copied up from pageable memory)
        span = torch.full((1,), self.timeline[-1].end if self.timeline else 0.0, dtype=torch.float64, device=self.device)
        comm.all_reduce(span, self.group, GROUP, op=dist.ReduceOp.MAX)
        self._idle = (busy, span)  # read when asked, after the step: no host sync inside it

    @property
    def idle_fraction(self) -> float:
        """The last step's idle fraction of this rank (its bubble)."""
        if isinstance(self._idle, tuple):
            busy, span = self._idle[0], self._idle[1].item()
            self._idle = 1 - busy / span if span > 0 else 0.0
        return self._idle

    # --- evaluation -----------------------------------------------------------------------------
    @torch.no_grad()
    def forward_only(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One batch through every chunk, in order; the loss on the last stage's rank, 0 elsewhere."""
        self._begin()
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        batch = [(inputs, targets)].__getitem__
        for c in self.layout.chunks_of(self.rank):
            out, _ = self._forward(Action("F", 0, c), self._input(Action("F", 0, c), batch), batch, 1)
            if out is not None:
                loss += out.double()
        self._wait_sends()
        return loss
