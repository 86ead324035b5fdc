"""ZeRO-3 (Rajbhandari et al. 2020; what FSDP calls full sharding): the parameters themselves are
partitioned. Each rank keeps 1/N of every unit's parameters, gradients and optimizer states
(16Ψ/N bytes with fp32 Adam) and assembles a unit's full parameters only while it computes:

  forward:  all-gather unit i (prefetched while unit i-1 ran), compute, free; prefetch unit i+1
  backward: all-gather unit i again (prefetched), compute, reduce-scatter its gradients into this
            rank's shard, free the full gradients and parameters; prefetch unit i-1

A unit is the token embedding (with learned positions and their norm), each transformer block,
and the final norm with the head. Per step and rank: Ψ(N-1)/N gathered forward, Ψ(N-1)/N gathered
backward, Ψ(N-1)/N reduce-scattered, 3Ψ(N-1)/N in all. With tied embeddings the embedding stays
gathered from its forward until the head's backward has used it (the head reads it last).

A unit's full parameters are views into one flat tensor whose storage is resized to zero when the
unit is freed and back when it is gathered, so autograd's saved references stay valid.

The shards are the fp32 masters the optimizer updates. With a gather dtype (`--gather-dtype bf16`,
FSDP2's param_dtype; ZeRO-1/2 use it alike, strata/parallel/gradients.py) each gather sends the
shard cast to it, so the full parameters, and the layers computing with them, are in that dtype,
and each unit moves half the bytes; gradients come back in it and are staged in the reduce
dtype, and a checkpoint gathers the fp32 masters themselves.

ZeRO-Infinity (Rajbhandari et al. 2021; `--offload-params cpu|disk`, strata/memory/tiers.py): the
shards and their gradients live in a tier, not in memory. A unit's shard is read (in the background,
one unit ahead) before its gather and dropped once gathered: the tier's copy is current, only the
optimizer changes it. Its gradient shard is written after each reduce-scatter (read first only when
an earlier micro-batch of the step left one), with the per-piece norms of the final gradient taken
then, so that clipping needs no second pass. The optimizer runs a unit at a time (`stream_units`),
the shard and gradient read, the clip applied, the updated shard written back. One process
(dp 1) runs the same code with copies for collectives, as ZeRO-Infinity does on one device."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

from strata.distributed import comm
from strata.memory import tiers
from strata.memory.tiers import Tier
from strata.parallel.buckets import Bucket, plan_buckets, shard_pieces
from strata.parallel.gradients import gather_shards, norm_pairs, pair_norms, sharded_optimizer_pieces, tensor_bytes
from strata.parallel.tensor import shard_specs
from strata.rules.constants import MAX_IN_FLIGHT


class Unit:
    """Modules whose parameters are gathered and freed together; one shard of them per rank."""

    def __init__(self, index: int, modules: list[nn.Module], keep_after_forward: bool):
        self.index, self.modules, self.keep_after_forward = index, modules, keep_after_forward
        self.slots: list[tuple[nn.Module, str, str]] = []  # (owning module, attribute, full name)
        self.full: torch.Tensor | None = None  # flat, all parameters of the unit (when gathered)
        self.shard: torch.Tensor | None = None  # this rank's slice, always held
        self.shard_grad: torch.Tensor | None = None
        self.bucket: Bucket | None = None  # the unit's flat layout (offsets, padded size)
        self.offset_of: dict[int, int] = {}  # id(parameter) -> its offset in `full`
        self.gathered, self.pending_gather = False, None
        self.gather_source: torch.Tensor | None = None  # the shard in the gather dtype, while it is sent
        self.staging: torch.Tensor | None = None  # the full gradient, during backward
        self.ready = 0
        self.pieces: list[int] = []  # indices of its pieces in ShardParameters.pieces
        # offloaded (--offload-params): reads in flight, and what the tier holds
        self.shard_read = self.grad_read = None
        self.shard_here = self.grad_here = True  # in memory, or on its way there (a read is queued)
        self.grad_zero = True  # the gradient shard is zero (nothing written to the tier this step)
        self.grad_norms: list[torch.Tensor] = []  # per piece, of the final gradient


class ShardParameters:
    """ZeRO-3, the sharding strategy data parallelism uses at stage 3 (strata/parallel/data.py)."""

    stage = 3
    reduce_every_micro_batch = True

    def __init__(self, model: nn.Module, settings, init_fn: Callable[[str], torch.Tensor] | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, tier: Tier | None = None):
        """model may be on the meta device: then init_fn(name) gives each parameter's initial
        value (this rank's tensor-parallel slice), and only one unit is ever materialised in full
        at a time. tier: where the shards and their gradients live (None: in memory)."""
        self.model, self.settings, self.group, self.tier = model, settings, settings.dp_group, tier
        self.dp_size, self.dp_rank = settings.dp_size, settings.dp_rank
        self._pending: list = []
        self.final = True  # this backward is the step's last micro-batch (its gradients are final)
        self.clip: tuple[float, torch.Tensor] | None = None  # offloaded: applied as the optimizer reads
        self.pinned = False  # `in_memory()`: every shard held
        self.peak_buffer_bytes = 0  # gathered units and staged gradients alive at once, at most
        names = {id(p): n for n, p in model.named_parameters()}
        tied = model.tied_weight() is not None  # the head reads the first unit's matrix last: keep it
        self.units = [Unit(i, mods, keep_after_forward=(i == 0 and tied)) for i, mods in enumerate(model.units())]
        self.pieces, self.shard_params = [], []
        for unit in self.units:
            for module in unit.modules:
                for attr, p in module.named_parameters(recurse=True):
                    owner_name, _, leaf = attr.rpartition(".")
                    owner = module.get_submodule(owner_name) if owner_name else module
                    unit.slots.append((owner, leaf, names[id(p)]))
            self._materialise(unit, init_fn, device, dtype)
        self.params = [getattr(o, a) for u in self.units for o, a, _ in u.slots]
        # offloaded with tensor parallelism: the pieces of parameters each tp rank saw only part of,
        # summed over tp as the unit's final gradient leaves (DataParallel does it for in-memory ones)
        specs, named = shard_specs(model), {id(p): n for n, p in model.named_parameters()}
        self.partial = {i for i, pc in enumerate(self.pieces) if specs[named[id(pc.param)]].partial_grad} \
            if tier is not None and settings.tp_group is not None else set()
        self.grad_hooks: list = []
        for unit in self.units:
            self._register_hooks(unit)
        model.register_forward_hook(self._after_model_forward)

    # --- layout and initialisation ------------------------------------------------------------
    def _materialise(self, unit: Unit, init_fn, device, dtype) -> None:
        """dtype: the masters'. The initial values are written in it, and this rank keeps its slice."""
        originals = [getattr(owner, attr) for owner, attr, _ in unit.slots]
        (bucket,), size = plan_buckets(originals, bucket_elems=2**62, dp_size=self.dp_size)
        unit.bucket = bucket
        masters = torch.zeros(size, dtype=dtype, device=device)
        compute_dtype = self.settings.gather_dtype or dtype
        unit.full = masters if compute_dtype == dtype else torch.zeros(size, dtype=compute_dtype, device=device)
        new_params = []
        for (owner, attr, name), p, offset in zip(unit.slots, originals, bucket.offsets):
            with torch.no_grad():
                masters[offset:offset + p.numel()].copy_(
                    init_fn(name).reshape(-1) if p.is_meta else p.detach().reshape(-1))
            # A tensor on the unit's storage with a version counter of its own (not a view of
            # `full`): the all-gathers that refill the storage must not look to autograd like
            # in-place changes of the weights it saved for backward.
            alias = torch.empty(0, dtype=compute_dtype, device=device).set_(unit.full.untyped_storage(), offset,
                                                                           p.shape)
            param = nn.Parameter(alias, requires_grad=p.requires_grad)
            setattr(owner, attr, param)
            new_params.append(param)
        bucket.params = new_params
        unit.offset_of = {id(p): offset for p, offset in zip(new_params, bucket.offsets)}
        lo, hi = bucket.shard(self.dp_rank, self.dp_size)
        unit.shard = masters[lo:hi].clone()
        unit.shard_grad = torch.zeros_like(unit.shard)
        for piece in shard_pieces([bucket], self.dp_rank, self.dp_size):
            n = piece.end - piece.start
            shard = unit.shard[piece.shard_index:piece.shard_index + n]
            shard.grad = unit.shard_grad[piece.shard_index:piece.shard_index + n]
            unit.pieces.append(len(self.pieces))
            self.pieces.append(piece)
            self.shard_params.append(shard)
        self._free(unit)
        if self.tier is not None:
            self.tier.reserve(f"shard{unit.index}", unit.shard)
            self.tier.reserve(f"grad{unit.index}", unit.shard_grad)
            self.tier.evict(f"shard{unit.index}", unit.shard, dirty=True)
            self.tier.evict(f"grad{unit.index}", unit.shard_grad, dirty=False)
            unit.shard_here = unit.grad_here = False

    # --- gather and free ----------------------------------------------------------------------
    def _gather(self, unit: Unit) -> None:
        """Start the all-gather of a unit's parameters (no wait; an offloaded shard is read first)."""
        if unit.gathered or unit.pending_gather is not None:
            return
        self._load_shard(unit)
        unit.full.untyped_storage().resize_(unit.full.numel() * unit.full.element_size())
        unit.gather_source = unit.shard.to(unit.full.dtype)  # the shard itself without a gather dtype
        if self.group is None:  # one process: the shard is the whole unit
            unit.full.copy_(unit.gather_source)
            unit.gather_source, unit.gathered = None, True
            self._drop_shard(unit)
        else:
            unit.pending_gather = comm.all_gather(unit.full, unit.gather_source, self.group, "dp", async_op=True)
        self._count_buffers()

    # --- the tier (--offload-params) --------------------------------------------------------------
    def _fetch_shard(self, unit: Unit) -> None:
        """Start reading an offloaded shard back, unless it is in memory or on its way."""
        if self.tier is not None and not unit.shard_here:
            unit.shard_read = self.tier.fetch(f"shard{unit.index}", unit.shard)
            unit.shard_here = True

    def _load_shard(self, unit: Unit) -> None:
        """The shard in memory now (a no-op when it is not offloaded)."""
        self._fetch_shard(unit)
        tiers.wait(unit.shard_read)
        unit.shard_read = None

    def _drop_shard(self, unit: Unit, dirty: bool = False) -> None:
        """Free an offloaded shard's memory (the tier's copy is current unless `dirty`)."""
        if self.tier is not None and not self.pinned and unit.shard_here:
            self.tier.evict(f"shard{unit.index}", unit.shard, dirty)
            unit.shard_here = False

    def _fetch_grad(self, unit: Unit):
        """The unit's gradient shard in memory: zeros when the tier holds none this step."""
        if self.tier is None or unit.grad_here:
            return
        unit.grad_read = self.tier.zeros(unit.shard_grad) if unit.grad_zero else \
            self.tier.fetch(f"grad{unit.index}", unit.shard_grad)
        unit.grad_here = True

    def _unit_grads(self, unit: Unit) -> list[torch.Tensor]:
        return [self.shard_params[i].grad for i in unit.pieces]

    def _count_buffers(self) -> None:
        alive = sum(u.full.untyped_storage().nbytes() + (tensor_bytes([u.staging]) if u.staging is not None else 0)
                    for u in self.units)
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, alive)

    def _ensure_gathered(self, unit: Unit) -> None:
        self._gather(unit)
        if unit.pending_gather is not None:
            unit.pending_gather.wait()
            unit.pending_gather = unit.gather_source = None
            unit.gathered = True
            self._drop_shard(unit)

    def _free(self, unit: Unit) -> None:
        unit.full.untyped_storage().resize_(0)
        unit.gathered = False

    def _prefetch(self, index: int, direction: int) -> None:
        """Start gathering the unit computed next; offloaded, start reading its shard and the
        next one's (read-ahead), and on one process gather it only if its read has landed, so
        compute does not wait here (with data parallelism the gather is issued now regardless:
        the ranks' collectives must come in the same order)."""
        if not 0 <= index < len(self.units):
            return
        unit = self.units[index]
        if self.tier is None:
            self._gather(unit)
            return
        if not (unit.gathered or unit.pending_gather is not None):
            self._fetch_shard(unit)
            # every rank must issue its collectives in one order, whatever its disk's timing
            if unit.shard_read is None or unit.shard_read.done() or self.group is not None:
                self._gather(unit)
        if 0 <= index + direction < len(self.units) and not self.units[index + direction].gathered:
            self._fetch_shard(self.units[index + direction])

    # --- hooks --------------------------------------------------------------------------------
    def _register_hooks(self, unit: Unit) -> None:
        for module in unit.modules:
            module.register_forward_pre_hook(partial(self._before_forward, unit))
            module.register_full_backward_pre_hook(partial(self._before_backward, unit))
        unit.modules[-1].register_forward_hook(partial(self._after_forward, unit))
        # held by the parameters' C++ side: removed at close() (see gradients.BucketReductions)
        self.grad_hooks += [param.register_post_accumulate_grad_hook(partial(self._on_grad_ready, unit))
                            for param in unit.bucket.params]

    def _before_forward(self, unit: Unit, module, args) -> None:
        self._ensure_gathered(unit)
        self._prefetch(unit.index + 1, 1)

    def _after_forward(self, unit: Unit, module, args, output) -> None:
        if not unit.keep_after_forward:
            self._free(unit)

    def _after_model_forward(self, module, args, output) -> None:
        if not torch.is_grad_enabled():  # no backward will come to free the kept units
            for unit in self.units:
                if unit.gathered:
                    self._free(unit)

    def _before_backward(self, unit: Unit, module, grad_output) -> None:
        self._ensure_gathered(unit)
        self._prefetch(unit.index - 1, -1)

    def _on_grad_ready(self, unit: Unit, param: nn.Parameter) -> None:
        if unit.staging is None:  # staged directly in the dtype it travels in
            unit.staging = unit.shard.new_zeros(unit.bucket.size, dtype=self.settings.reduce_dtype or unit.shard.dtype)
            self._count_buffers()
        offset = unit.offset_of[id(param)]
        unit.staging[offset:offset + param.numel()].copy_(param.grad.reshape(-1))
        param.grad = None
        unit.ready += 1
        if unit.ready == len(unit.bucket.params):
            self._reduce(unit)
            self._free(unit)

    def _reduce(self, unit: Unit) -> None:
        if unit.staging is None:  # no gradient reached this unit: reduce zeros
            unit.staging = unit.shard.new_zeros(unit.bucket.size, dtype=self.settings.reduce_dtype or unit.shard.dtype)
        lo, hi = unit.bucket.shard(self.dp_rank, self.dp_size)
        self._pending.append((unit, None if self.group is None else
                              comm.reduce_scatter(unit.staging[lo:hi], unit.staging, self.group, "dp", async_op=True)))
        unit.ready = -1  # reduced for this backward
        while len(self._pending) > MAX_IN_FLIGHT:  # bound the full gradients alive at once
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        unit, work = self._pending.pop(0)
        if work is not None:
            work.wait()
        lo, hi = unit.bucket.shard(self.dp_rank, self.dp_size)
        if self.tier is not None and unit.grad_zero:
            # The step's first gradient of the unit: the reduced shard is the gradient itself (adding
            # it to zeros changes at most the sign of a zero, which no later arithmetic sees), so it
            # goes to the tier as it is, without a zeroed buffer and an add.
            self._leave(unit, unit.staging[lo:hi].to(unit.shard_grad.dtype))  # from the reduce dtype
            unit.staging = None
            return
        self._fetch_grad(unit)
        tiers.wait(unit.grad_read)
        unit.grad_read = None
        unit.shard_grad.add_(unit.staging[lo:hi])  # a sum: the loss carried 1/dp
        unit.staging = None
        if self.tier is not None:
            self._leave(unit, unit.shard_grad)
            self.tier.evict(f"grad{unit.index}", unit.shard_grad, dirty=False)  # written by _leave
            unit.grad_here = False

    def _leave(self, unit: Unit, grad: torch.Tensor) -> None:
        """Write a unit's accumulated gradient shard to the tier; on the step's last micro-batch take
        its pieces' norms first (clipping needs them, and the gradient is leaving memory)."""
        if self.final:
            views = {i: grad[self.pieces[i].shard_index:self.pieces[i].shard_index + self.pieces[i].end -
                             self.pieces[i].start] for i in unit.pieces}
            partial = [views[i] for i in unit.pieces if i in self.partial]
            if partial:  # every tp rank completes its units in the same order: one sum per unit
                flat = torch.cat([v.reshape(-1) for v in partial])
                comm.all_reduce(flat, self.settings.tp_group, "tp")
                for view, summed in zip(partial, flat.split([v.numel() for v in partial])):
                    view.copy_(summed.view_as(view))
            unit.grad_norms = norm_pairs([views[i] for i in unit.pieces])
        self.tier.write(f"grad{unit.index}", grad)
        unit.grad_zero = False

    # --- what data parallelism calls -------------------------------------------------------------
    @contextmanager
    def backward(self, sync: bool, final: bool = True):
        """Gradients are reduce-scattered on every micro-batch: no full gradient is kept. final:
        the step's last micro-batch."""
        self.final = final
        with warnings.catch_warnings():
            # The embedding's inputs are token ids: its backward pre-hook fires on the output
            # gradient alone, which is what we want.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            yield
        for unit in self.units:
            if unit.ready != -1:
                self._reduce(unit)
        while self._pending:
            self._complete_oldest()
        for unit in self.units:
            unit.ready = 0
            if unit.gathered:
                self._free(unit)

    def reduce_all(self) -> None:
        raise NotImplementedError("ZeRO-3 runs without pipeline stages (strata/rules/layout.py refuses it)")

    def grad_pairs(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        return [(s.grad, pc.param) for pc, s in zip(self.pieces, self.shard_params)]

    def grad_norm_pairs(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """(the norm of this rank's piece of a gradient, its parameter); offloaded, the norms taken
        as the final gradients were written."""
        if self.tier is None:
            return pair_norms(self.grad_pairs())
        norms = {i: n for unit in self.units for i, n in zip(unit.pieces, unit.grad_norms)}
        return [(norms[i], pc.param) for i, pc in enumerate(self.pieces)]

    def clip_(self, max_norm: float, total_norm: torch.Tensor) -> None:
        if self.tier is None:
            torch.nn.utils.clip_grads_with_norm_([g for g, _ in self.grad_pairs()], max_norm, total_norm)
        else:  # the same arithmetic, on each unit's gradients as the optimizer reads them
            self.clip = (max_norm, total_norm)

    def stream_units(self):
        """For the optimizer: this rank's shards, a unit at a time, each with its gradient in
        memory (the next unit read meanwhile); the updated shard is written back after. Yields the
        unit's shard tensors (the optimizer's, in `optimizer_pieces`)."""
        for unit in self.units:
            for ahead in (unit, self.units[unit.index + 1] if unit.index + 1 < len(self.units) else None):
                if ahead is not None:
                    self._fetch_shard(ahead)
                    self._fetch_grad(ahead)
            for read in ("shard_read", "grad_read"):
                tiers.wait(getattr(unit, read))
                setattr(unit, read, None)
            if self.clip is not None:
                torch.nn.utils.clip_grads_with_norm_(self._unit_grads(unit), *self.clip)
            yield [self.shard_params[i] for i in unit.pieces]
            self._drop_shard(unit, dirty=True)
            if self.tier is not None:  # zero_grad follows: nothing to write
                self.tier.evict(f"grad{unit.index}", unit.shard_grad, dirty=False)
                unit.grad_here = False
        self.clip = None

    @contextmanager
    def in_memory(self):
        """Every offloaded shard read into memory and held (checkpoints read and write them);
        written back and freed after."""
        if self.tier is None:
            yield
            return
        for unit in self.units:
            self._load_shard(unit)
        self.pinned = True
        try:
            yield
        finally:
            self.pinned = False
            for unit in self.units:
                self._drop_shard(unit, dirty=True)

    @property
    def offloaded_bytes(self) -> int:
        """What the tier holds: the shards and their gradients."""
        return self.tier.bytes_held() if self.tier is not None else 0

    def close(self) -> None:
        for handle in self.grad_hooks:
            handle.remove()
        self.grad_hooks = []
        if self.tier is not None:
            self.tier.close()

    def optimizer_pieces(self) -> list[tuple[torch.Tensor, nn.Parameter, int, int]]:
        return sharded_optimizer_pieces(self.pieces, self.shard_params)

    def after_step(self) -> None:
        """Nothing: the updated shards are what the next forward gathers."""

    def prepare_step(self) -> None:
        """Nothing: the optimizer updates this rank's shards, which carry their gradients."""

    def zero_grad(self) -> None:
        for unit in self.units:
            if self.tier is None:
                unit.shard_grad.zero_()
            else:  # nothing to write: the next gradient is added to zeros made then
                unit.grad_zero, unit.grad_norms = True, []

    def held_bytes(self) -> dict[str, int]:
        """In memory now: offloaded shards and gradients count only while they are read in (or
        on their way in; an eviction counts as done when it is queued)."""
        if self.tier is None:
            return {"params": tensor_bytes(self.shard_params), "grads": tensor_bytes(g for g, _ in self.grad_pairs())}
        return {kind: sum(tensor_bytes([getattr(u, tensor)]) for u in self.units if getattr(u, here))
                for kind, tensor, here in (("params", "shard", "shard_here"), ("grads", "shard_grad", "grad_here"))}

    @torch.no_grad()
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's parameters (the fp32 masters, gathered a unit at a time into a tensor
        of their own, whatever the gather dtype) and persistent buffers."""
        state = {}
        for unit in self.units:
            self._load_shard(unit)
            masters = gather_shards(unit.shard, unit.full.numel(), self.group) if self.group is not None else \
                unit.shard.clone()
            self._drop_shard(unit)
            for (_, _, name), param, offset in zip(unit.slots, unit.bucket.params, unit.bucket.offsets):
                state[name] = masters[offset:offset + param.numel()].view(param.shape).clone()
        for name, buf in self.model.named_buffers():
            if name in self.model.state_dict():
                state[name] = buf.detach().clone()
        return state
