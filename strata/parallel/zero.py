"""ZeRO stages 1 and 2 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC 2020) on the bucketed buffers of data parallelism.

Rank r owns shard r of every bucket (strata/parallel/buckets.py). The optimizer sees only the
pieces of the parameters in this rank's shards, so Adam's moments take 8Ψ/N bytes in fp32.
- ZeRO-1 keeps the full gradient buffer (gradient accumulation adds up locally, as in plain data
  parallelism) and, on the last micro-batch, reduce-scatters each bucket as soon as it is complete:
  this rank receives the sum of its own shard only.
- ZeRO-2 keeps only this rank's shard of the gradients: each bucket is staged while backward fills
  it, reduce-scattered, and the staging freed. With gradient accumulation this happens on every
  micro-batch (as in DeepSpeed), since no full gradient is kept between them.
After the optimizer step each bucket's updated shards are all-gathered into the parameters, which
live in one flat buffer so the all-gather writes them in place. Per step and rank this moves
Ψ(N-1)/N in the reduce-scatter and Ψ(N-1)/N in the all-gather: 2Ψ(N-1)/N, as plain all-reduce."""

from __future__ import annotations

import torch
from torch import nn

from strata.distributed import comm
from strata.parallel.buckets import Bucket, shard_pieces
from strata.parallel.data import DataParallel, _bytes


class ShardedStates:
    """What ZeRO-1, 2 and 3 share: the optimizer updates only this rank's pieces of the parameters
    (`self.pieces`, `self.shard_params`, each shard with its gradient shard as .grad)."""

    pieces: list
    shard_params: list[torch.Tensor]
    grads_sharded = True

    def optimizer_pieces(self):
        pairs = list(zip(self.shard_params, self.pieces))
        ordered = [x for x in pairs if x[1].decays] + [x for x in pairs if not x[1].decays]
        return [(shard, pc.param, pc.start - pc.offset, pc.end - pc.offset) for shard, pc in ordered]

    def grad_pairs(self):
        return [(s.grad, pc.param) for pc, s in zip(self.pieces, self.shard_params)]


class ZeroDataParallel(ShardedStates, DataParallel):
    def __init__(self, model: nn.Module, group, stage: int, bucket_mb: float = 25.0, tp_group=None):
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel handles stages 1 and 2, not {stage}")
        self.stage = stage
        self.reduce_every_micro_batch = stage == 2
        super().__init__(model, group, bucket_mb, tp_group)
        sample = self.params[0]
        # Parameters move into one flat buffer, one at a time (each original is freed as its
        # .data is replaced, so the model is never held twice).
        self.param_buffer = torch.empty(self.total, dtype=sample.dtype, device=sample.device)
        for bucket in self.buckets:
            end = bucket.offsets[-1] + bucket.params[-1].numel()
            self.param_buffer[end:bucket.start + bucket.size].zero_()  # the padding
            for p, offset in zip(bucket.params, bucket.offsets):
                view = self.param_buffer[offset:offset + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
        self._offset_of = {id(p): off for b in self.buckets for p, off in zip(b.params, b.offsets)}
        self.pieces = shard_pieces(self.buckets, self.dp_rank, self.dp_size)
        # What the optimizer updates: views of this rank's shards of the parameter buffer, each
        # with its gradient shard as .grad.
        self.shard_params = [self.param_buffer[pc.start:pc.end] for pc in self.pieces]
        for piece, shard in zip(self.pieces, self.shard_params):
            shard.grad = (self.grad_buffer[piece.start:piece.end] if stage == 1 else
                          self.shard_grad_buffer[piece.shard_index:piece.shard_index + piece.end - piece.start])

    def _setup_grads(self, dtype, device) -> None:
        if self.stage == 1:
            return super()._setup_grads(dtype, device)
        self.shard_grad_buffer = torch.zeros(self.total // self.dp_size, dtype=dtype, device=device)
        self._staging: dict[int, torch.Tensor] = {}
        for p in self.params:
            p.grad = None

    def _staging_for(self, bucket: Bucket) -> torch.Tensor:
        if bucket.index not in self._staging:
            sample = self.shard_grad_buffer  # staged directly in the dtype it travels in
            self._staging[bucket.index] = torch.zeros(bucket.size, dtype=self.reduce_dtype or sample.dtype,
                                                      device=sample.device)
        return self._staging[bucket.index]

    def _collect(self, bucket: Bucket, param: nn.Parameter) -> None:
        if self.stage == 1:
            return super()._collect(bucket, param)
        offset = self._offset_of[id(param)] - bucket.start
        self._staging_for(bucket)[offset:offset + param.numel()].copy_(param.grad.reshape(-1))
        param.grad = None  # the full gradient is not kept: that is ZeRO-2

    def _start_reduction(self, bucket: Bucket):
        lo, hi = bucket.shard(self.dp_rank, self.dp_size)
        flat = self.grad_buffer[bucket.start:bucket.start + bucket.size] if self.stage == 1 else \
            self._staging_for(bucket)
        self._wires[bucket.index] = wire = self._on_wire(flat)
        shard = wire[lo - bucket.start:hi - bucket.start]
        return comm.reduce_scatter(shard, wire, self.group, "dp", async_op=True)

    def _reduced(self, bucket: Bucket) -> None:
        lo, hi = bucket.shard(self.dp_rank, self.dp_size)
        wire = self._wires.pop(bucket.index)
        if self.stage == 1:
            if wire.dtype != self.grad_buffer.dtype:
                self.grad_buffer[lo:hi].copy_(wire[lo - bucket.start:hi - bucket.start])
            self.grad_buffer[lo:hi].div_(self.dp_size)
            return
        first = bucket.start // self.dp_size  # this bucket's place in the gradient shard
        staged = self._staging.pop(bucket.index)[lo - bucket.start:hi - bucket.start]
        self.shard_grad_buffer[first:first + hi - lo].add_(staged, alpha=1 / self.dp_size)

    def after_step(self) -> None:
        """All-gather every bucket's updated shards into the parameters."""
        pending = []
        for bucket in self.buckets:
            lo, hi = bucket.shard(self.dp_rank, self.dp_size)
            pending.append(comm.all_gather(self.param_buffer[bucket.start:bucket.start + bucket.size],
                                           self.param_buffer[lo:hi], self.group, "dp", async_op=True))
            if len(pending) > self.max_in_flight:
                pending.pop(0).wait()
        for work in pending:
            work.wait()

    def zero_grad(self) -> None:
        (self.grad_buffer if self.stage == 1 else self.shard_grad_buffer).zero_()

    def state_bytes(self, optimizer) -> dict[str, int]:
        grads = _bytes(self.params) if self.stage == 1 else _bytes(self.local_grads())
        return {**super().state_bytes(optimizer), "grads": grads}
