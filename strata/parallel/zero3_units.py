"""ZeRO-3's units and their gathering (strata/parallel/zero3.py has the strategy as a whole).

A unit is modules whose parameters are gathered and freed together (the family's `units()`: the
token embedding with its positions and norm, each block, the final norm with the head). Its full
parameters are views into one flat tensor, `full`, whose storage is resized to zero when the unit
is freed and back when it is gathered, so autograd's saved references stay valid; this rank keeps
its shard of the fp32 masters (`shard`) always. With a gather dtype (FSDP2's param_dtype) `full`
is in that dtype and each gather sends the shard cast to it.

ZeRO++'s hpZ (Wang et al. 2023, section 3.2; `--hpz-partition-size K`): a unit freed after a forward
that backward will follow leaves this rank its slice of the gathered unit (`secondary`: 1/K of it,
in the gather dtype), and the unit's next gather assembles it from the K ranks of its node group
(intra-node) instead of the N ranks' shards; the copy goes once gathered, or when the parameters
change (the optimizer step).

An offloaded shard (ZeRO-Infinity, strata/memory/offloaded_shards.py) is read in before its
gather and dropped once gathered."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from strata.distributed import comm
from strata.memory.offloaded_shards import OffloadedShards
from strata.parallel.buckets import Bucket, Piece, plan_buckets, shard_pieces
from strata.parallel.sharding import gather_shards, tensor_bytes


class Unit:
    """Modules whose parameters are gathered and freed together; one shard of them per rank."""

    def __init__(self, index: int, modules: list[nn.Module], keep_after_forward: bool, keep_through_step: bool = False):
        self.index, self.modules, self.keep_after_forward = index, modules, keep_after_forward
        # under a pipeline: gathered until the schedule ends, not freed by its reduce-scatters (every
        # unit with reshard_after_forward off; a last stage's tied matrix, which the head reads first)
        self.keep_through_step = keep_through_step
        self.reads: list[Unit] = []  # units this one's forward and backward read too (a head: the tied matrix)
        self.slots: list[tuple[nn.Module, str, str]] = []  # (owning module, attribute, full name)
        self.full: torch.Tensor | None = None  # flat, all parameters of the unit (when gathered)
        self.shard: torch.Tensor | None = None  # this rank's slice, always held
        self.shard_grad: torch.Tensor | None = None
        self.bucket: Bucket | None = None  # the unit's flat layout (offsets, padded size)
        self.offset_of: dict[int, int] = {}  # id(parameter) -> its offset in `full`
        self.gathered, self.pending_gather = False, None
        self.gather_source: torch.Tensor | None = None  # the shard in the gather dtype, while it is sent
        self.secondary: torch.Tensor | None = None  # hpZ: this rank's 1/K of the gathered unit, forward to backward
        self.staging: torch.Tensor | None = None  # the full gradient, during backward
        self.reducing: list[torch.Tensor] = []  # earlier stagings whose reduce-scatter is in flight
        self.ready = 0  # gradients arrived since its last reduce-scatter
        self.reduced = False  # reduce-scattered in this backward (or schedule)
        self.pieces: list[int] = []  # indices of its pieces in UnitGathers.pieces
        self.grad_norms: list[torch.Tensor] = []  # offloaded: per piece, of the final gradient


class UnitGathers:
    """Every unit's layout and shards, and the all-gathers that assemble a unit and the frees."""

    def __init__(self, units: list[Unit], settings, offload: OffloadedShards | None, node=None):
        """node: hpZ's group (a mesh Axis, "dp_node"), or None."""
        self.units, self.settings, self.offload, self.node = units, settings, offload, node
        self.group, self.dp_size, self.dp_rank = settings.dp_group, settings.dp_size, settings.dp_rank
        self.pieces: list[Piece] = []  # this rank's part of each parameter, unit by unit
        self.shard_params: list[torch.Tensor] = []  # the pieces' views of the shards, each with its .grad
        self.peak_buffer_bytes = 0  # gathered units and staged gradients alive at once, at most

    # --- layout and initialisation ------------------------------------------------------------
    def materialise(self, unit: Unit, names: dict[int, str], init_fn: Callable[..., torch.Tensor] | None,
                    device, dtype: torch.dtype) -> None:
        """Give the unit its flat storage and this rank's shard of the initial values (a meta
        parameter's from init_fn(name, (start, end)), the elements of the rank's slice of it
        flattened, made alone); dtype: the masters'. names: id(parameter) -> its name."""
        for module in unit.modules:
            for attr, p in module.named_parameters(recurse=True):
                owner_name, _, leaf = attr.rpartition(".")
                owner = module.get_submodule(owner_name) if owner_name else module
                unit.slots.append((owner, leaf, names[id(p)]))
        originals = [getattr(owner, attr) for owner, attr, _ in unit.slots]
        (bucket,), size = plan_buckets(originals, bucket_elems=2**62, dp_size=self.dp_size)
        unit.bucket = bucket
        compute_dtype = self.settings.gather_dtype or dtype
        unit.full = torch.empty(size, dtype=compute_dtype, device=device)  # its storage is freed below
        lo, hi = bucket.shard(self.dp_rank, self.dp_size)
        unit.shard = torch.zeros(hi - lo, dtype=dtype, device=device)  # the alignment's padding stays 0
        names_of = {id(p): name for (_, _, name), p in zip(unit.slots, originals)}
        with torch.no_grad():  # only this rank's shard of each parameter is made (issue 53, item 7)
            for piece in shard_pieces([bucket], self.dp_rank, self.dp_size):
                p, elements = piece.param, (piece.start - piece.offset, piece.end - piece.offset)
                unit.shard[piece.start - lo:piece.end - lo].copy_(
                    init_fn(names_of[id(p)], elements) if p.is_meta else p.detach().reshape(-1)[slice(*elements)])
        new_params = []
        for (owner, attr, name), p, offset in zip(unit.slots, originals, bucket.offsets):
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
        unit.shard_grad = torch.zeros_like(unit.shard)
        for piece in shard_pieces([bucket], self.dp_rank, self.dp_size):
            n = piece.end - piece.start
            shard = unit.shard[piece.shard_index:piece.shard_index + n]
            shard.grad = unit.shard_grad[piece.shard_index:piece.shard_index + n]
            unit.pieces.append(len(self.pieces))
            self.pieces.append(piece)
            self.shard_params.append(shard)
        self.free(unit)
        if self.offload is not None:
            self.offload.add(unit.index, unit.shard, unit.shard_grad)

    # --- gather and free ----------------------------------------------------------------------
    def gather(self, unit: Unit) -> None:
        """Start the all-gather of a unit's parameters (no wait; an offloaded shard is read first)."""
        if unit.gathered or unit.pending_gather is not None:
            return
        unit.full.untyped_storage().resize_(unit.full.numel() * unit.full.element_size())
        if unit.secondary is not None:  # hpZ: from the node's copies (no offload with it: rules/layout.py)
            unit.gather_source = unit.secondary
            unit.pending_gather = comm.all_gather(unit.full, unit.secondary, self.node.group, self.node.name,
                                                  async_op=True)
            self.count_buffers()
            return
        self.load_shard(unit)
        unit.gather_source = unit.shard.to(unit.full.dtype)  # the shard itself without a gather dtype
        if self.group is None:  # one process: the shard is the whole unit
            unit.full.copy_(unit.gather_source)
            unit.gather_source, unit.gathered = None, True
            self.drop_shard(unit)
        else:
            unit.pending_gather = comm.all_gather(unit.full, unit.gather_source, self.group, self.settings.group_name,
                                                  async_op=True)
        self.count_buffers()

    def ensure_gathered(self, unit: Unit) -> None:
        self.gather(unit)
        if unit.pending_gather is not None:
            unit.pending_gather.wait()
            unit.pending_gather = unit.gather_source = unit.secondary = None
            unit.gathered = True
            self.drop_shard(unit)

    def free(self, unit: Unit, keep_secondary: bool = False) -> None:
        """keep_secondary: under hpZ, keep this rank's slice of the unit for its backward's gather."""
        if keep_secondary and self.node is not None and unit.secondary is None:
            size = unit.full.numel() // self.node.size  # the unit is padded to a multiple of dp, which K divides
            unit.secondary = unit.full[self.node.rank * size:(self.node.rank + 1) * size].clone()
        unit.full.untyped_storage().resize_(0)
        unit.gathered = False
        if keep_secondary:
            self.count_buffers()

    def drop_secondaries(self) -> None:
        """The parameters changed (or the backward is over): hpZ's copies are stale."""
        for unit in self.units:
            unit.secondary = None

    def count_buffers(self) -> None:
        """Track the peak of gathered units, staged gradients (and hpZ's copies) alive at once."""
        alive = sum(u.full.untyped_storage().nbytes() + (tensor_bytes([u.staging]) if u.staging is not None else 0)
                    + tensor_bytes(u.reducing) + (tensor_bytes([u.secondary]) if u.secondary is not None else 0)
                    for u in self.units)
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, alive)

    def full_masters(self, unit: Unit) -> torch.Tensor:
        """The unit's fp32 masters, all-gathered into a tensor of their own (whatever the gather dtype)."""
        self.load_shard(unit)
        masters = gather_shards(unit.shard, unit.full.numel(), self.group, self.settings.group_name) if self.group is not None else \
            unit.shard.clone()
        self.drop_shard(unit)
        return masters

    # --- an offloaded shard (no-ops in memory) --------------------------------------------------
    def load_shard(self, unit: Unit) -> None:
        if self.offload is not None:
            self.offload.load_shard(unit.index)

    def drop_shard(self, unit: Unit, dirty: bool = False) -> None:
        if self.offload is not None:
            self.offload.drop_shard(unit.index, dirty)

    def unit_grads(self, unit: Unit) -> list[torch.Tensor]:
        return [self.shard_params[i].grad for i in unit.pieces]
