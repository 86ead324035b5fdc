"""ZeRO stages 0, 1 and 2: gradients in flat buckets, each reduced as soon as backward completes
it; the stages differ only in what a bucket's reduction does and what the optimizer holds.

As the field does it (Li et al., "PyTorch Distributed", VLDB 2020; megatron-core's
param_and_grad_buffer; Rajbhandari et al., "ZeRO", SC 2020):
- `BucketReductions` (strata/parallel/bucket_reductions.py) counts each bucket's arriving gradients
  (post-accumulate-grad hooks) and starts the bucket's collective when the last one is in,
  overlapping the rest of backward. Those whose reduction holds memory of its own (ZeRO-2's staging
  buffer, a bucket cast to the reduce dtype) are limited to two in flight; a reduction in place
  in ZeRO-0/1's permanent gradient buffer is not limited (rules/buckets.in_flight_limit).
  Micro-batches before the last of an accumulation communicate nothing.
- The reductions sum: the average over the data-parallel ranks is in each rank's loss already
  (`DataParallel.loss_factor`, 1/dp), as DDP divides while copying into its buckets, so no stage
  makes a pass over the gradients to divide them.
- ZeRO-0 (`Replicate`): a step starts with no `.grad`; each micro-batch's hook puts the gradient
  into one flat buffer and makes the view `.grad`, so later micro-batches accumulate in place; a
  bucket is all-reduced. One process has no buffer: its gradients stay autograd's.
- ZeRO-1 (`ShardOptimizerStates`): the same gradient buffer, reduce-scattered: rank r receives the
  sum of its shard only, and the optimizer updates only this rank's pieces (Adam's moments take
  8Ψ/N bytes); after the step each bucket's shards are all-gathered into the parameters, which live
  in one flat buffer so the all-gather writes them in place.
- ZeRO-2 (`ShardGradients`): no full gradient buffer: a bucket is staged while backward fills it,
  reduce-scattered, added into this rank's gradient shard and freed; with gradient accumulation
  this runs every micro-batch (as in DeepSpeed), since no full gradient survives between them.
  Under a pipeline autograd accumulates them whole; one reduce-scatter follows the schedule.
Per step and rank each moves 2Ψ(N-1)/N: an all-reduce, or a reduce-scatter plus an all-gather.
Gradients travel in the reduce dtype, ZeRO-1/2's parameters in the gather dtype (bf16: the
weights are bf16 copies of fp32 master shards, `_ShardedBuckets`). Each stage is a
`ShardingStrategy` (strata/parallel/sharding.py)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from strata.distributed import comm
from strata.parallel.bucket_reductions import BucketReductions
from strata.parallel.buckets import (
    Bucket,
    GradientBuffer,
    Piece,
    broadcast_parameters,
    bucket_elements,
    flat_parameters,
    plan_buckets,
    shard_pieces,
)
from strata.parallel.parameter_gathers import ParameterGathers
from strata.parallel.sharding import gather_shards, pair_norms, sharded_optimizer_pieces, tensor_bytes
from strata.rules.buckets import in_flight_limit


class _Buckets:
    """What the three stages share: the parameters laid out back to front in aligned buckets padded
    to a multiple of dp (so each splits into equal shards), and the reductions over them."""

    reduce_every_micro_batch = False
    offloaded = False  # everything is in memory (ZeRO-Infinity is ZeRO-3's: zero3.py)
    expert_names: frozenset[str] = frozenset()  # a mixture's experts get a strategy of their own: ExpertSplit

    def __init__(self, params: list[nn.Parameter], settings):
        self.params, self.settings, self.group = params, settings, settings.dp_group
        self.group_name = settings.group_name
        self.dp_size, self.dp_rank = settings.dp_size, settings.dp_rank
        sample = params[0]
        self.master_dtype = sample.dtype  # the parameters as given: what the optimizer updates
        self.buckets, self.total = plan_buckets(list(reversed(params)), bucket_elements(settings.bucket_mb, sample.dtype),
                                                self.dp_size, aligned=True)
        if self.group is not None:
            broadcast_parameters(self.buckets, self.group, self.group_name)
        reduces_in_place = (settings.reduce_dtype or self.master_dtype) == self._gradient_dtype()
        # the stage's steps, looked up when they run (a stage sets some of them after this)
        self.reductions = BucketReductions(self.buckets, lambda b, p: self._collect(b, p), lambda b: self._start(b),
                                           lambda b: self._finish(b), hooked=self.group is not None,
                                           limit=in_flight_limit(self.stage, reduces_in_place))
        self._wires: dict[int, torch.Tensor] = {}  # bucket index -> what is being reduced

    def _gradient_dtype(self) -> torch.dtype:
        """What the stage collects gradients in: the weights' dtype (ZeRO-1/2 override it)."""
        return self.master_dtype

    def _on_wire(self, flat: torch.Tensor) -> torch.Tensor:
        """What a reduction sends: the gradient itself, or a copy in the reduce dtype (without one,
        the masters': bf16 gradients of bf16 weights are summed in fp32)."""
        wanted = self.settings.reduce_dtype or self.master_dtype
        return flat if wanted == flat.dtype else flat.to(wanted)

    @contextmanager
    def backward(self, sync: bool, final: bool = True):
        """Around one micro-batch's backward: with sync, its buckets are reduced as they complete
        and all of them by the end; without (an accumulation micro-step), gradients add up.
        final (the step's last micro-batch) matters to ZeRO-3's offload only."""
        self.reductions.sync = self.group is None or sync
        yield
        if self.group is not None and sync:
            self.reductions.complete()

    def prepare_step(self) -> None:
        """Before the optimizer step (ZeRO-0 with separate targets hands them the gradients)."""

    def grad_norm_pairs(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """(the norm of this rank's gradient of a parameter, or of its piece; the parameter)."""
        return pair_norms(self.grad_pairs())

    def clip_(self, max_norm: float, total_norm: torch.Tensor) -> None:
        torch.nn.utils.clip_grads_with_norm_([g for g, _ in self.grad_pairs()], max_norm, total_norm)

    def stream_units(self):
        """Everything is in memory: one group, every tensor the optimizer updates."""
        yield [tensor for tensor, _, _, _ in self.optimizer_pieces()]

    def overlap_gathers(self, units: list[tuple[nn.Module, list[nn.Parameter]]]) -> None:
        """Nothing: only ZeRO-1/2 gather parameters after the step."""

    def wait_parameters(self) -> None:
        """Nothing in flight: only ZeRO-1/2 gather parameters after the step."""

    def separate_optimizer_targets(self) -> None:
        """Nothing: the optimizer updates views of the flat buffer (or the masters), never the
        parameter objects (ZeRO-0 overrides this)."""

    @contextmanager
    def in_memory(self):
        """Everything is in memory already (ZeRO-3's offloaded shards are not: zero3.py)."""
        yield

    def stats(self) -> dict[str, int]:
        """What this rank holds now (ZeRO-2 adds its staging buffers)."""
        return {"params_bytes": self._params_bytes(), "grads_bytes": self._grads_bytes()}

    def close(self) -> None:
        """The gradient hooks (ZeRO-3 also releases its tier files)."""
        self.reductions.remove_hooks()

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state: every rank holds it already."""
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def reduce_all(self) -> None:
        if self.group is not None:
            self.reductions.sync = True  # ZeRO-2 collects (from autograd's accumulated gradients) now
            self.reductions.complete()  # collects every bucket first: none was launched

    def _collect(self, bucket: Bucket, param: nn.Parameter) -> None:
        raise NotImplementedError

    def _start(self, bucket: Bucket):
        raise NotImplementedError

    def _finish(self, bucket: Bucket) -> None:
        raise NotImplementedError

    def _params_bytes(self) -> int:
        raise NotImplementedError

    def _grads_bytes(self) -> int:
        raise NotImplementedError


class Replicate(_Buckets):
    """ZeRO-0: every rank holds and updates the whole model; a bucket is all-reduced."""

    stage = 0
    grads_partitioned = False  # every rank holds the whole average

    def __init__(self, params: list[nn.Parameter], settings):
        super().__init__(params, settings)
        # One process reduces nothing: its gradients stay autograd's own, with no buffer to fill.
        self.gradients = GradientBuffer(self.buckets, self.total, params[0]) if self.group is not None else None
        self.grad_buffer = self.gradients.flat if self.gradients is not None else None
        self._collect = self.gradients.collect if self.gradients is not None else None
        self.targets: dict[nn.Parameter, torch.Tensor] = {}  # what the optimizer updates in a parameter's place

    def _start(self, bucket: Bucket):
        self._wires[bucket.index] = wire = self._on_wire(self.grad_buffer[bucket.start:bucket.start + bucket.size])
        return comm.all_reduce(wire, self.group, self.group_name, async_op=True)

    def _finish(self, bucket: Bucket) -> None:
        flat, wire = self.grad_buffer[bucket.start:bucket.start + bucket.size], self._wires.pop(bucket.index)
        if wire is not flat:
            flat.copy_(wire)

    def grad_pairs(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        return [(p.grad, p) for p in self.params if p.grad is not None]

    def optimizer_pieces(self) -> list[tuple[torch.Tensor, nn.Parameter, int, int]]:
        """Each parameter whole (or its separate target), matrices first."""
        ordered = [p for p in self.params if p.dim() >= 2] + [p for p in self.params if p.dim() < 2]
        return [(self.targets.get(p, p), p, 0, p.numel()) for p in ordered]

    def separate_optimizer_targets(self) -> None:
        """Asynchronous schedules: the optimizer updates, in place, tensors sharing each parameter's
        storage (its `.data`, with an autograd version counter of its own) rather than the
        parameters, whose counters the graphs of micro-batches still in flight check (ZeRO-1/2
        update views of their flat buffer already). Their gradients are handed over in `prepare_step`."""
        self.targets = {p: p.data for p in self.params}

    def prepare_step(self) -> None:
        for p, target in self.targets.items():
            target.grad = p.grad

    def after_step(self) -> None:
        """Nothing to do: every replica applied the same update."""

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for target in self.targets.values():  # else they would keep the last step's gradients alive
            target.grad = None

    def _params_bytes(self) -> int:
        return tensor_bytes(self.params)

    def _grads_bytes(self) -> int:
        return tensor_bytes(g for g, _ in self.grad_pairs())


class _ShardedBuckets(_Buckets):
    """ZeRO-1 and 2: the parameters in one flat buffer; the optimizer updates this rank's shard of
    every bucket (1-D views, each with its gradient shard as .grad); the updated shards are
    all-gathered after the step.

    With a gather dtype (`--gather-dtype bf16`, DeepSpeed's bf16 ZeRO) the flat buffer, and so the
    weights the layers compute with, is bf16, and this rank's shards of the fp32 masters are held
    apart (`masters`, with `master_grads` under ZeRO-1): the optimizer updates the masters, each
    is cast into its place in the buffer, and the all-gather moves bf16. Gradients arrive in bf16
    (no casts under autocast: the weights are bf16 already)."""

    grads_partitioned = True  # each rank reduces its own shard

    def __init__(self, params: list[nn.Parameter], settings):
        super().__init__(params, settings)
        self.pieces: list[Piece] = shard_pieces(self.buckets, self.dp_rank, self.dp_size)
        compute_dtype = settings.gather_dtype or self.master_dtype
        self.masters = None
        if compute_dtype != self.master_dtype:  # copied from the fp32 values before they are cast
            self.masters = torch.zeros(self.total // self.dp_size, dtype=self.master_dtype, device=params[0].device)
            for pc in self.pieces:
                self._shard_of(self.masters, pc).copy_(pc.param.detach().reshape(-1)[pc.start - pc.offset:
                                                                                     pc.end - pc.offset])
        self.param_buffer = flat_parameters(self.buckets, self.total, params[0], compute_dtype)
        self.gathers = ParameterGathers(self.buckets)  # the updated shards', in flight into the next forward
        self._offset_of = {id(p): off for b in self.buckets for p, off in zip(b.params, b.offsets)}
        self.shard_params = [self._shard_of(self.masters, pc) if self.masters is not None
                             else self.param_buffer[pc.start:pc.end] for pc in self.pieces]

    def _gradient_dtype(self) -> torch.dtype:
        return self.settings.gather_dtype or self.master_dtype  # the flat buffer's: the weights'

    @staticmethod
    def _shard_of(shards: torch.Tensor, pc: Piece) -> torch.Tensor:
        """A piece's place in tensors holding this rank's shards end to end."""
        return shards[pc.shard_index:pc.shard_index + pc.end - pc.start]

    def _bucket_shard(self, shards: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        """A bucket's shard in tensors holding this rank's shards end to end."""
        first = bucket.start // self.dp_size
        return shards[first:first + bucket.size // self.dp_size]

    def grad_pairs(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        return [(s.grad, pc.param) for pc, s in zip(self.pieces, self.shard_params)]

    def optimizer_pieces(self) -> list[tuple[torch.Tensor, nn.Parameter, int, int]]:
        return sharded_optimizer_pieces(self.pieces, self.shard_params)

    def after_step(self) -> None:
        """Start the all-gather of every bucket's updated shards into the parameters, in place,
        each waited for by the next forward's unit that reads it (parameter_gathers.py)."""
        self.gathers.wait()
        for bucket in reversed(self.buckets):  # the first layers' first
            lo, hi = bucket.shard(self.dp_rank, self.dp_size)
            if self.masters is not None:
                self.param_buffer[lo:hi].copy_(self._bucket_shard(self.masters, bucket))
            self.gathers.started(bucket, comm.all_gather(self.param_buffer[bucket.start:bucket.start + bucket.size],
                                                         self.param_buffer[lo:hi], self.group, self.group_name,
                                                         async_op=True))

    def overlap_gathers(self, units: list[tuple[nn.Module, list[nn.Parameter]]]) -> None:
        self.gathers.watch(units)

    def wait_parameters(self) -> None:
        self.gathers.wait()

    def prepare_step(self) -> None:
        self.gathers.wait()  # a bucket no forward read (a stage's unused parameters) is done by now

    def in_memory(self):
        self.gathers.wait()  # a checkpoint reads whole parameters
        return super().in_memory()

    def close(self) -> None:
        self.gathers.close()
        super().close()

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's state, with the parameters as the fp32 masters when the weights are bf16
        copies (gathered a bucket at a time)."""
        self.gathers.wait()
        state = super().full_state_dict(model)
        if self.masters is not None:
            names = {id(p): n for n, p in model.named_parameters()}
            for bucket in self.buckets:
                flat = gather_shards(self._bucket_shard(self.masters, bucket), bucket.size, self.group,
                                     self.group_name)
                for p, offset in zip(bucket.params, bucket.offsets):
                    state[names[id(p)]] = flat[offset - bucket.start:offset - bucket.start + p.numel()].view(p.shape)
        return state

    def _params_bytes(self) -> int:
        masters = [self.masters] if self.masters is not None else []
        return tensor_bytes([*self.params, *masters])


class ShardOptimizerStates(_ShardedBuckets):
    """ZeRO-1: the full gradient buffer is kept; each bucket is reduce-scattered into it."""

    stage = 1

    def __init__(self, params: list[nn.Parameter], settings):
        super().__init__(params, settings)
        self.gradients = GradientBuffer(self.buckets, self.total, params[0])  # in the weights' dtype
        self.grad_buffer = self.gradients.flat
        self._collect = self.gradients.collect
        # the reduced shard, in the masters' dtype: the buffer's own, or apart when the weights are bf16
        self.master_grads = torch.zeros_like(self.masters) if self.masters is not None else None
        for piece, shard in zip(self.pieces, self.shard_params):
            shard.grad = self.grad_buffer[piece.start:piece.end] if self.masters is None \
                else self._shard_of(self.master_grads, piece)

    def _start(self, bucket: Bucket):
        lo, hi = bucket.shard(self.dp_rank, self.dp_size)
        self._wires[bucket.index] = wire = self._on_wire(self.grad_buffer[bucket.start:bucket.start + bucket.size])
        return comm.reduce_scatter(wire[lo - bucket.start:hi - bucket.start], wire, self.group, self.group_name, async_op=True)

    def _finish(self, bucket: Bucket) -> None:
        lo, hi = bucket.shard(self.dp_rank, self.dp_size)
        wire = self._wires.pop(bucket.index)
        if self.masters is None:  # reduced in place unless it travelled in another dtype
            reduced = self.grad_buffer[lo:hi]
            if wire.dtype != reduced.dtype:
                reduced.copy_(wire[lo - bucket.start:hi - bucket.start])
        else:
            reduced = self._bucket_shard(self.master_grads, bucket)
            reduced.copy_(wire[lo - bucket.start:hi - bucket.start])

    def zero_grad(self) -> None:
        self.gradients.release()

    def _grads_bytes(self) -> int:
        return tensor_bytes(self.params) + (tensor_bytes([self.master_grads]) if self.masters is not None else 0)


class ShardGradients(_ShardedBuckets):
    """ZeRO-2: only this rank's shard of the gradients is kept; buckets are staged, reduce-scattered
    and added to it, on every micro-batch.

    A reduced bucket's staging buffer goes back to a pool that the next bucket takes (zeroed), as
    DeepSpeed keeps its reduction buckets: a fresh buffer each time made the host first-touch every
    page of it again (1.06 million page faults more than ZeRO-0 in 8 steps of `small` on 4 ranks,
    68 MB a micro-batch and rank, and 27% of the step). Every buffer has the largest bucket's size,
    so any bucket fits any of them; the pool holds as many as are ever staged at once,
    MAX_IN_FLIGHT + 1 (one filling while the others reduce): the planner counts them as buffers
    (plan/cost.py: _buffers)."""

    stage = 2

    def __init__(self, params: list[nn.Parameter], settings):
        super().__init__(params, settings)
        self.reduce_every_micro_batch = settings.pp_group is None  # a pipeline's: once, in reduce_all
        self.shard_grad_buffer = torch.zeros(self.total // self.dp_size, dtype=self.master_dtype,
                                             device=params[0].device)
        self._staging: dict[int, torch.Tensor] = {}  # bucket index -> the buffer its gradient is staged in
        self._spare: list[torch.Tensor] = []  # reduced buffers, for the next buckets
        self._staging_size = max(b.size for b in self.buckets)
        self.peak_buffer_bytes = 0  # the staging buffers allocated (all of them are kept)
        for p in self.params:
            p.grad = None
        for piece, shard in zip(self.pieces, self.shard_params):
            shard.grad = self.shard_grad_buffer[piece.shard_index:piece.shard_index + piece.end - piece.start]

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "peak_buffer_bytes": self.peak_buffer_bytes}

    def _staging_for(self, bucket: Bucket) -> torch.Tensor:
        if bucket.index not in self._staging:
            if self._spare:
                self._staging[bucket.index] = self._spare.pop()
                self._staging[bucket.index][:bucket.size].zero_()
            else:  # staged directly in the dtype it travels in
                sample = self.shard_grad_buffer
                self._staging[bucket.index] = staging = torch.zeros(
                    self._staging_size, dtype=self.settings.reduce_dtype or sample.dtype, device=sample.device)
                self.peak_buffer_bytes += tensor_bytes([staging])
        return self._staging[bucket.index][:bucket.size]

    def _collect(self, bucket: Bucket, param: nn.Parameter) -> None:
        if param.grad is None or not self.reductions.sync:  # collected, or none came (zeros staged); or
            return  # accumulating in autograd's gradient until reduce_all (a pipeline's)
        offset = self._offset_of[id(param)] - bucket.start
        self._staging_for(bucket)[offset:offset + param.numel()].copy_(param.grad.reshape(-1))
        param.grad = None  # the full gradient is not kept: that is ZeRO-2

    def _start(self, bucket: Bucket):
        lo, hi = bucket.shard(self.dp_rank, self.dp_size)
        self._wires[bucket.index] = wire = self._on_wire(self._staging_for(bucket))
        return comm.reduce_scatter(wire[lo - bucket.start:hi - bucket.start], wire, self.group, self.group_name, async_op=True)

    def _finish(self, bucket: Bucket) -> None:
        lo, hi = bucket.shard(self.dp_rank, self.dp_size)
        self._wires.pop(bucket.index)
        first = bucket.start // self.dp_size  # this bucket's place in the gradient shard
        staging = self._staging.pop(bucket.index)
        self.shard_grad_buffer[first:first + hi - lo].add_(staging[lo - bucket.start:hi - bucket.start])
        self._spare.append(staging)

    def zero_grad(self) -> None:
        self.shard_grad_buffer.zero_()

    def _grads_bytes(self) -> int:
        return tensor_bytes(g for g, _ in self.grad_pairs())

