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

Under a pipeline (`stage_units`) a stage shards its own units over its dp group, and the backward
context wraps the whole schedule. With reshard_after_forward (FSDP's name; the default) each
micro-batch gathers and reduce-scatters as above: m x 3Ψ_stage(N-1)/N, no full gradient kept.
Without it (torchtitan's choice with pipelining) the stage's units are gathered once, kept
through its micro-batches, their gradients summed whole and reduce-scattered once after the
schedule: 2Ψ_stage(N-1)/N, for holding the stage's parameters and gradients whole. A tied
embedding is a unit of its own on the first and the last stage, so the copies' gradient shards are
summed over the two stages (parallel/data.py), 1/N of the matrix each.

The shards are the fp32 masters the optimizer updates. With a gather dtype (`--gather-dtype bf16`,
FSDP2's param_dtype; ZeRO-1/2 use it alike, strata/parallel/gradients.py) each gather sends the
shard cast to it, so the full parameters, and the layers computing with them, are in that dtype,
and each unit moves half the bytes; gradients come back in it and are staged in the reduce
dtype, and a checkpoint gathers the fp32 masters themselves.

ZeRO-Infinity (Rajbhandari et al. 2021; `--offload-params cpu|disk`): the shards and their
gradients live in a tier, not in memory; the strategy is given it (strata/memory/offloaded_shards.py,
which streams each unit's tensors in and out). A unit's shard is read (in the background,
one unit ahead) before its gather and dropped once gathered: the tier's copy is current, only the
optimizer changes it. Its gradient shard is written after each reduce-scatter (read first only when
an earlier micro-batch of the step left one), with the per-piece norms of the final gradient taken
then, so that clipping needs no second pass. The optimizer runs a unit at a time (`stream_units`),
the shard and gradient read, the clip applied, the updated shard written back. One process
(dp 1) runs the same code with copies for collectives, as ZeRO-Infinity does on one device.

ZeRO++'s hpZ (Wang et al. 2023, section 3.2; `--hpz-partition-size K`, DeepSpeed's
zero_hpz_partition_size): the shards, the optimizer and the reduce-scatters stay over all N ranks;
a unit freed after its forward leaves each rank 1/K of it (the gather dtype's), and its backward
gathers it from the K adjacent ranks of the node group ("dp_node") alone. Per micro-batch:
Ψ(N-1)/N gathered forward and Ψ(N-1)/N reduce-scattered over dp, Ψ(K-1)/K gathered backward over the
node; Ψ/K more held from the forward to the backward (zero3_units.py).

Here: the strategy (`ShardParameters`, what data parallelism calls) and where a reduced gradient
shard goes; zero3_units.py: the units, their layout and the gathers; zero3_hooks.py: the forward,
backward and gradient hooks, prefetching and the reduce-scatters."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

from strata.distributed import comm
from strata.memory.offloaded_shards import OffloadedShards
from strata.parallel.sharding import norm_pairs, pair_norms, sharded_optimizer_pieces, tensor_bytes
from strata.parallel.tensor import shard_specs
from strata.parallel.zero3_hooks import UnitHooks
from strata.parallel.zero3_units import Unit, UnitGathers
from strata.rules.units import unit_count


class ShardParameters:
    """ZeRO-3, the sharding strategy data parallelism uses at stage 3 (strata/parallel/data.py): the
    units and their gathers (zero3_units.py), the hooks that drive them (zero3_hooks.py), and,
    offloaded, the tier they stream from (strata/memory/offloaded_shards.py)."""

    stage = 3
    grads_partitioned = True
    reduce_every_micro_batch = True
    expert_names: frozenset[str] = frozenset()  # parallelize() keeps mixtures off ZeRO-3's path

    def __init__(self, model: nn.Module, settings, init_fn: Callable[..., torch.Tensor] | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 offload: OffloadedShards | None = None, node=None):
        """model may be on the meta device: then init_fn(name, (start, end)) gives the elements
        [start, end) of each parameter's initial value (of this rank's tensor-parallel slice,
        flattened): a rank makes only its shard. offload: the tier the shards and their gradients
        live in (None: in memory). node: hpZ's group (a mesh Axis), or None."""
        self.model, self.settings, self.group, self.offload = model, settings, settings.dp_group, offload
        self.offloaded = offload is not None
        self.dp_size, self.dp_rank = settings.dp_size, settings.dp_rank
        self.final = True  # this backward is the step's last micro-batch (its gradients are final)
        self.clip: tuple[float, torch.Tensor] | None = None  # offloaded: applied as the optimizer reads
        names = {id(p): n for n, p in model.named_parameters()}
        self.units = stage_units(model, settings.pp_group is not None, settings.keep_gathered)
        if settings.pp_group is None:
            assert len(self.units) == unit_count(len(model.layers())), "the planner prices rules/units.py's units"
        self.gathers = UnitGathers(self.units, settings, offload, node)
        for unit in self.units:
            self.gathers.materialise(unit, names, init_fn, device, dtype)
        self.pieces, self.shard_params = self.gathers.pieces, self.gathers.shard_params
        self.params = [getattr(o, a) for u in self.units for o, a, _ in u.slots]
        # offloaded with tensor parallelism: the pieces of parameters each tp rank saw only part of,
        # summed over tp as the unit's final gradient leaves (DataParallel does it for in-memory ones)
        specs, named = shard_specs(model), {id(p): n for n, p in model.named_parameters()}
        self.partial = {i for i, pc in enumerate(self.pieces) if specs[named[id(pc.param)]].partial_grad} \
            if offload is not None and settings.tp_group is not None else set()
        self.hooks = UnitHooks(model, self.gathers, settings, self._receive)

    # --- where a reduced gradient shard goes ------------------------------------------------------
    def _receive(self, unit: Unit, reduced: torch.Tensor) -> None:
        """Add this rank's reduced shard of a unit's gradient to the unit's gradient shard (a sum:
        the loss carried 1/dp); offloaded, the sum goes to the tier."""
        if self.offload is None:
            unit.shard_grad.add_(reduced)
            return
        if self.offload.grad_is_zero(unit.index):
            # The step's first gradient of the unit: the reduced shard is the gradient itself (adding
            # it to zeros changes at most the sign of a zero, which no later arithmetic sees), so it
            # goes to the tier as it is, without a zeroed buffer and an add.
            self._leave(unit, reduced.to(unit.shard_grad.dtype))  # from the reduce dtype
            return
        self.offload.load_grad(unit.index)
        unit.shard_grad.add_(reduced)
        self._leave(unit, unit.shard_grad)
        self.offload.drop_grad(unit.index)  # written by _leave

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
        self.offload.write_grad(unit.index, grad)

    # --- what data parallelism calls (strata/parallel/sharding.py) ---------------------------------
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
        self.hooks.finish_backward()

    def reduce_all(self) -> None:
        """Nothing: under a pipeline the backward context around the schedule reduced every unit."""

    def grad_pairs(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        return [(s.grad, pc.param) for pc, s in zip(self.pieces, self.shard_params)]

    def grad_norm_pairs(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """(the norm of this rank's piece of a gradient, its parameter); offloaded, the norms taken
        as the final gradients were written."""
        if self.offload is None:
            return pair_norms(self.grad_pairs())
        norms = {i: n for unit in self.units for i, n in zip(unit.pieces, unit.grad_norms)}
        return [(norms[i], pc.param) for i, pc in enumerate(self.pieces)]

    def clip_(self, max_norm: float, total_norm: torch.Tensor) -> None:
        if self.offload is None:
            torch.nn.utils.clip_grads_with_norm_([g for g, _ in self.grad_pairs()], max_norm, total_norm)
        else:  # the same arithmetic, on each unit's gradients as the optimizer reads them
            self.clip = (max_norm, total_norm)

    def stream_units(self):
        """For the optimizer: this rank's shards, a unit at a time, each with its gradient in
        memory (the next unit read meanwhile); the updated shard is written back after. Yields the
        unit's shard tensors (the optimizer's, in `optimizer_pieces`)."""
        for unit in self.units:
            if self.offload is not None:
                self.offload.read_ahead(unit.index)
                if unit.index + 1 < len(self.units):
                    self.offload.read_ahead(unit.index + 1)
                self.offload.wait_reads(unit.index)
            if self.clip is not None:
                torch.nn.utils.clip_grads_with_norm_(self.gathers.unit_grads(unit), *self.clip)
            yield [self.shard_params[i] for i in unit.pieces]
            if self.offload is not None:  # zero_grad follows: the gradient need not be written
                self.offload.drop_shard(unit.index, dirty=True)
                self.offload.drop_grad(unit.index)
        self.clip = None

    def separate_optimizer_targets(self) -> None:
        """Nothing: the optimizer updates this rank's shards, never the parameter objects (and
        ZeRO-3 runs without the asynchronous schedules that ask for it)."""

    @contextmanager
    def in_memory(self):
        """Every offloaded shard read into memory and held (checkpoints read and write them);
        written back and freed after."""
        if self.offload is None:
            yield
            return
        with self.offload.in_memory():
            yield

    def stats(self) -> dict[str, int]:
        """What is held in memory now (offloaded shards and gradients only while they are read in,
        or on their way in: an eviction counts as done when it is queued), the peak of the gathered
        units and staged gradients, and what the tier holds."""
        if self.offload is None:
            params_bytes, grads_bytes = tensor_bytes(self.shard_params), tensor_bytes(g for g, _ in self.grad_pairs())
        else:
            params_bytes, grads_bytes = self.offload.held_bytes()
        counters = {"params_bytes": params_bytes, "grads_bytes": grads_bytes,
                    "peak_buffer_bytes": self.gathers.peak_buffer_bytes}
        if self.offload is not None:
            counters["offloaded_bytes"] = self.offload.bytes_held()
        return counters

    def close(self) -> None:
        self.hooks.remove()
        if self.offload is not None:
            self.offload.close()

    def optimizer_pieces(self) -> list[tuple[torch.Tensor, nn.Parameter, int, int]]:
        return sharded_optimizer_pieces(self.pieces, self.shard_params)

    def after_step(self) -> None:
        """The updated shards are what the next forward gathers; hpZ's copies (of the old values) go."""
        self.gathers.drop_secondaries()

    def overlap_gathers(self, units) -> None:
        """Nothing: the units' hooks gather (zero3_hooks.py)."""

    def wait_parameters(self) -> None:
        """Nothing: a unit's parameters are whole only while gathered, for its forward or backward."""

    def prepare_step(self) -> None:
        """Nothing: the optimizer updates this rank's shards, which carry their gradients."""

    def zero_grad(self) -> None:
        if self.offload is None:
            for unit in self.units:
                unit.shard_grad.zero_()
            return
        self.offload.zero_grads()  # nothing to write: the next gradient is added to zeros made then
        for unit in self.units:
            unit.grad_norms = []

    @torch.no_grad()
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's parameters (the fp32 masters, gathered a unit at a time into a tensor
        of their own, whatever the gather dtype) and persistent buffers."""
        state = {}
        for unit in self.units:
            masters = self.gathers.full_masters(unit)
            for (_, _, name), param, offset in zip(unit.slots, unit.bucket.params, unit.bucket.offsets):
                state[name] = masters[offset:offset + param.numel()].view(param.shape).clone()
        for name, buf in self.model.named_buffers():
            if name in self.model.state_dict():
                state[name] = buf.detach().clone()
        return state


def stage_units(model: nn.Module, pipelined: bool, keep_gathered: bool) -> list[Unit]:
    """The units of the model this rank holds. Alone, the model's own (a tied embedding's unit kept
    from its forward to the head's backward). A pipeline stage holds some of them: the others are
    left out; a tied matrix is a unit of its own on the first stage and on the last (where the head
    reads it, its unit kept gathered through the schedule, read by the outputs' unit), so that the
    two copies are sharded alike and their gradients summed shard by shard; with keep_gathered,
    every unit stays gathered through the step's micro-batches."""
    groups = [modules for modules in model.units() if modules]
    tied = model.tied_weight()
    if not pipelined:
        return [Unit(i, mods, keep_after_forward=(i == 0 and tied is not None)) for i, mods in enumerate(groups)]
    if tied is not None:
        owner = next(m for m in groups[0] if any(p is tied for p in m.parameters(recurse=False)))
        rest = [m for m in groups[0] if m is not owner]
        groups = [[owner], *([rest] if rest else []), *groups[1:]]
    reads_tied = tied is not None and bool(model.output_layers())  # the last stage: its head reads the matrix
    units = [Unit(i, mods, keep_after_forward=keep_gathered or (reads_tied and i == 0),
                  keep_through_step=keep_gathered or (reads_tied and i == 0)) for i, mods in enumerate(groups)]
    if reads_tied:
        units[-1].reads.append(units[0])
    return units
