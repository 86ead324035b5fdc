"""Data parallelism (`--zero 0`): every rank holds the whole model, starts from rank 0's weights and
averages its gradients with the other ranks before the optimizer step.

As the field does it (Li et al., "PyTorch Distributed", VLDB 2020; megatron-core's
param_and_grad_buffer): gradients live in one flat buffer, each parameter's `.grad` a view into it,
so autograd accumulates in place; the buffer is cut into buckets (`--bucket-mb`), and a bucket's
all-reduce starts from a backward hook as soon as its last gradient has arrived, overlapping the
rest of the backward pass. Micro-batches before the last one of an accumulation communicate
nothing.

`DataParallel` is also the interface the trainer sees for every ZeRO stage (strata/parallel/zero.py
subclasses it); with no process group it is the single-process case and never communicates."""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from strata.distributed import comm
from strata.parallel.buckets import Bucket, bucket_elements, plan_buckets
from strata.parallel.tensor import ShardSpec, shard_specs


@torch.no_grad()
def broadcast_parameters(buckets: list[Bucket], group) -> None:
    """Copy rank 0's parameters to every rank of the group, so all replicas start identical; one
    broadcast per bucket, through a buffer of one bucket's size."""
    for bucket in buckets:
        flat = torch.cat([p.detach().reshape(-1) for p in bucket.params])
        comm.broadcast(flat, 0, group, "dp")
        for p, piece in zip(bucket.params, flat.split([p.numel() for p in bucket.params])):
            p.copy_(piece.view_as(p))


class DataParallel:
    stage = 0
    # Collectives allowed in flight before the oldest is waited for. Two keep the network busy
    # while backward computes; more would only add the backend's temporary buffers (gloo copies
    # each message) and, under ZeRO-2/3, staging buffers of full gradients.
    max_in_flight = 2
    reduce_every_micro_batch = False  # ZeRO-2/3: no full gradient survives between micro-batches
    grads_sharded = False  # each dp rank holds a disjoint part of the gradient
    # Pipeline parallelism: each stage holds different parameters, so the norm's squares are
    # summed over the stages too; a tied embedding's second copy (last stage) counts once.
    pp_group = None
    counted_elsewhere: frozenset[int] = frozenset()  # id() of parameters left out of the norm
    # The dtype gradients travel in (--reduce-dtype); None: their own (fp32 master gradients).
    # bf16 halves the bytes; the sum is rounded to bf16 once per reduction.
    reduce_dtype: torch.dtype | None = None

    def __init__(self, model: nn.Module, group=None, bucket_mb: float = 25.0, tp_group=None):
        self.model, self.group, self.tp_group = model, group, tp_group
        self.dp_size = dist.get_world_size(group) if group is not None else 1
        self.dp_rank = dist.get_rank(group) if group is not None else 0
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._index_specs()
        sample = self.params[0]
        self.buckets, self.total = plan_buckets(list(reversed(self.params)),
                                                bucket_elements(bucket_mb, sample.dtype), self.dp_size)
        if group is not None:
            broadcast_parameters(self.buckets, group)
        self.sync_enabled = True
        self._ready = [0] * len(self.buckets)
        self._launched = [False] * len(self.buckets)
        self._pending: list = []
        self._wires: dict[int, torch.Tensor] = {}  # bucket index -> what is being reduced
        self._setup_grads(sample.dtype, sample.device)
        if group is not None:
            for bucket in self.buckets:
                for p in bucket.params:
                    p.register_post_accumulate_grad_hook(partial(self._on_grad_ready, bucket))

    def _index_specs(self) -> None:
        """How each parameter is split by tensor parallelism (replicated when not)."""
        specs = shard_specs(self.model)
        self._spec_of = {id(p): specs[name] for name, p in self.model.named_parameters()}

    def spec_of(self, param: nn.Parameter) -> ShardSpec:
        return self._spec_of[id(param)]

    # --- the gradient buffer ------------------------------------------------------------------
    def _setup_grads(self, dtype, device) -> None:
        self.grad_buffer = torch.zeros(self.total, dtype=dtype, device=device)
        self._grad_views = {}
        for bucket in self.buckets:
            for p, offset in zip(bucket.params, bucket.offsets):
                view = self.grad_buffer[offset:offset + p.numel()].view_as(p)
                self._grad_views[p] = view
                p.grad = view

    def _on_grad_ready(self, bucket: Bucket, param: nn.Parameter) -> None:
        if not self.sync_enabled:
            return  # an accumulation micro-step: gradients just add up in the buffer
        self._collect(bucket, param)
        self._ready[bucket.index] += 1
        if self._ready[bucket.index] == len(bucket.params):
            self._launch(bucket)

    def _collect(self, bucket: Bucket, param: nn.Parameter) -> None:
        """Make sure the bucket holds `param`'s gradient (here it accumulates in place)."""
        view = self._grad_views[param]
        if param.grad is not view:  # autograd replaced the view instead of adding into it
            view.copy_(param.grad)
            param.grad = view

    def _launch(self, bucket: Bucket) -> None:
        self._launched[bucket.index] = True
        self._pending.append((bucket, self._start_reduction(bucket)))
        while len(self._pending) > self.max_in_flight:
            self._complete_oldest()

    def _on_wire(self, flat: torch.Tensor) -> torch.Tensor:
        """What a reduction sends: the gradient itself, or a copy in the reduce dtype."""
        return flat if self.reduce_dtype in (None, flat.dtype) else flat.to(self.reduce_dtype)

    def _start_reduction(self, bucket: Bucket):
        flat = self.grad_buffer[bucket.start:bucket.start + bucket.size]
        self._wires[bucket.index] = wire = self._on_wire(flat)
        return comm.all_reduce(wire, self.group, "dp", async_op=True)

    def _complete_oldest(self) -> None:
        bucket, work = self._pending.pop(0)
        work.wait()
        self._reduced(bucket)

    def _reduced(self, bucket: Bucket) -> None:
        """A bucket's sum has arrived: turn it into the average."""
        flat, wire = self.grad_buffer[bucket.start:bucket.start + bucket.size], self._wires.pop(bucket.index)
        if wire is not flat:
            flat.copy_(wire)
        flat.div_(self.dp_size)

    # --- what the trainer calls ---------------------------------------------------------------
    @contextmanager
    def backward(self, is_last_micro_batch: bool):
        """Wrap each micro-batch's backward; gradients are reduced after the last one (after
        every one under ZeRO-2/3)."""
        self.sync_enabled = self.group is None or is_last_micro_batch or self.reduce_every_micro_batch
        yield
        if self.group is not None and self.sync_enabled:
            self._finish()
        if is_last_micro_batch:
            self._sum_partial_grads_over_tp()

    def _sum_partial_grads_over_tp(self) -> None:
        """Replicated parameters that each tensor-parallel rank saw only part of (norms under
        sequence parallelism, K/V projections shared by ranks): sum their gradients."""
        if self.tp_group is None:
            return
        grads = [g for g, p in self.grad_pairs() if self.spec_of(p).partial_grad]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce(flat, self.tp_group, "tp")
            for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(piece.view_as(g))

    def reduce_gradients(self) -> None:
        """After a pipeline schedule, which ran every backward inside `backward(False)`: reduce
        the accumulated gradients now, every bucket at once (the schedule's last backwards are
        spread over chunks and ranks, so there is no one backward to overlap with)."""
        if self.group is not None:
            for bucket in self.buckets:
                for param in bucket.params:
                    self._collect(bucket, param)
            self._finish()
        self._sum_partial_grads_over_tp()

    def _finish(self) -> None:
        for bucket in self.buckets:  # parameters that got no gradient: send their zeros anyway
            if not self._launched[bucket.index]:
                self._launch(bucket)
        while self._pending:
            self._complete_oldest()
        self._ready = [0] * len(self.buckets)
        self._launched = [False] * len(self.buckets)

    def optimizer_pieces(self) -> list[tuple[torch.Tensor, nn.Parameter, int, int]]:
        """What the optimizer updates, in its order: (tensor, the parameter it is part of, its
        flat range [lo, hi) in that parameter); here each parameter whole, matrices first."""
        ordered = [p for p in self.params if p.dim() >= 2] + [p for p in self.params if p.dim() < 2]
        return [(p, p, 0, p.numel()) for p in ordered]

    def optimizer_param_groups(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(tensors with weight decay, tensors without): matrices and embeddings decay, norms and
        biases do not."""
        pieces = self.optimizer_pieces()
        return [t for t, p, _, _ in pieces if p.dim() >= 2], [t for t, p, _, _ in pieces if p.dim() < 2]

    def grad_pairs(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """(gradient this rank holds, the parameter it belongs to)."""
        return [(p.grad, p) for p in self.params if p.grad is not None]

    def local_grads(self) -> list[torch.Tensor]:
        return [g for g, _ in self.grad_pairs()]

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the averaged gradient. Squares are summed in fp64 over what this
        rank holds, over the dp ranks when they hold disjoint parts (ZeRO), over the tp ranks
        for tensor-parallel slices (replicated parameters count once), and over the pipeline
        stages."""
        pairs = [(g, p) for g, p in self.grad_pairs() if id(p) not in self.counted_elsewhere]
        squares = torch.zeros(2, dtype=torch.float64, device=self.params[0].device)  # (tp-split, replicated)
        if pairs:
            norms = torch.stack(torch._foreach_norm([g for g, _ in pairs])).double()  # one kernel per dtype
            replicated = torch.tensor([self.spec_of(p).dim is None for _, p in pairs], device=norms.device)
            squares[0] = norms[~replicated].square().sum()
            squares[1] = norms[replicated].square().sum()
        if self.grads_sharded and self.group is not None:
            comm.all_reduce(squares, self.group, "dp")
        if self.tp_group is not None:
            split = squares[:1].clone()
            comm.all_reduce(split, self.tp_group, "tp")
            squares[0] = split[0]
        total = squares.sum()
        if self.pp_group is not None:
            comm.all_reduce(total, self.pp_group, "pp")
        return total.sqrt().to(self.params[0].dtype)

    def clip_(self, max_norm: float, total_norm: torch.Tensor) -> None:
        torch.nn.utils.clip_grads_with_norm_(self.local_grads(), max_norm, total_norm)

    def after_step(self) -> None:
        """Nothing to do: every replica applied the same update."""

    def zero_grad(self) -> None:
        self.grad_buffer.zero_()

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Model-state bytes this rank holds, counted from the tensors (padding not included)."""
        return {"params": _bytes(self.params), "grads": _bytes(self.local_grads()),
                "optimizer": optimizer_state_bytes(optimizer)}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The optimizer's per-element states (Adam's moments); its 0-dim step counters are left out,
    a few bytes per tensor that no formula of the field counts."""
    return _bytes(v for state in optimizer.state.values() for v in state.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0)
