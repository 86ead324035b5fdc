"""Expert parallelism (GShard, Lepikhin et al. 2020; DeepSpeed-MoE; Megatron-core's all-to-all
dispatcher): a mixture's experts split over an expert-parallel group carved out of the
data-parallel ranks (strata/rules/experts.py has the layout and the traffic formula).

Each MoE layer's routed rows (a token once per expert it is sent to, sorted by expert) go to the
rank holding their expert and come back with an all-to-all each way; the row counts are exchanged
first, since the splits are uneven. Both are autograd functions whose backward is the same
exchange the other way. The experts' parameters are the logical stacked tensors cut along the
expert dimension (a ShardSpec cut, with tensor parallelism's d_ff cut beside it), so a checkpoint
stays layout-free; their gradients are reduced over the expert-data-parallel group
(`ExpertSplit`), the dense parameters' over every data-parallel rank."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import nn

from strata.distributed import comm
from strata.distributed.mesh import Axis
from strata.model.families import get_family
from strata.parallel.sharding import ShardingStrategy
from strata.parallel.tensor import ShardSpec

GROUP, DATA_GROUP = "ep", "edp"


@dataclass(frozen=True)
class ExpertAxes:
    """This rank's expert-parallel group (size ep) and expert-data-parallel group (size dp / ep),
    from strata/distributed/mesh.expert_axes; a group is None where it has one rank."""
    ep: Axis
    edp: Axis


class RoutedRows:
    """What this rank's dispatches moved since the last reset, for the metrics and the traffic
    formula (rules/experts.all_to_all_bytes): rows sent to and received from each rank of the
    expert-parallel group, summed over layers and micro-batches, and the number of dispatches."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.sent: list[int] = []
        self.received: list[int] = []
        self.dispatches = 0

    def add(self, sent: list[int], received: list[int]) -> None:
        if not self.sent:
            self.sent, self.received = [0] * len(sent), [0] * len(received)
        self.sent = [a + b for a, b in zip(self.sent, sent)]
        self.received = [a + b for a, b in zip(self.received, received)]
        self.dispatches += 1


routed_rows = RoutedRows()


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, received: list[int], sent: list[int], group):
        ctx.received, ctx.sent, ctx.group = received, sent, group
        out = x.new_empty((sum(received), *x.shape[1:]))
        comm.all_to_all_uneven(out, x.contiguous(), received, sent, group, GROUP)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.sent), *grad.shape[1:]))
        comm.all_to_all_uneven(back, grad.contiguous(), ctx.sent, ctx.received, ctx.group, GROUP)
        return back, None, None, None


def expert_dispatch(axes: ExpertAxes, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor,
                    sizes: list[int] | None = None) -> torch.Tensor:
    """MoE.dispatch under expert parallelism. x: this rank's routed rows sorted by expert,
    counts[e] for global expert e (sizes: the same as a list, when the caller read it). Returns the
    experts' outputs for the same rows, in the same order. The rows each rank sends and receives
    are read from the device once, after the exchange of the counts."""
    ep = axes.ep.size
    local = counts.numel() // ep
    if torch.is_autocast_enabled(x.device.type):  # the experts compute in it: send the rows in it too
        x = x.to(torch.get_autocast_dtype(x.device.type))
    to_rank = counts.view(ep, local).contiguous()  # [j, e]: rows for rank j's local expert e
    from_rank = torch.empty_like(to_rank)  # [j, e]: rows rank j sends to this rank's expert e
    comm.all_to_all(from_rank, to_rank, axes.ep.group, GROUP)
    to_sizes, sizes = torch.stack([to_rank, from_rank]).tolist()
    sent, received = [sum(row) for row in to_sizes], [sum(row) for row in sizes]
    if torch._C._current_graph_task_id() == -1:  # a forward, not its recomputation in backward
        routed_rows.add(sent, received)
    rows = _AllToAll.apply(x, received, sent, axes.ep.group)  # by source rank, then by expert
    # by expert, then by source rank, for the experts (their rows per expert on the device for the
    # grouped product, on the host for the others); and back
    by_source = rows.split([sizes[j][e] for j in range(ep) for e in range(local)])
    by_expert = [by_source[j * local + e] for e in range(local) for j in range(ep)]
    rows_per_expert = [sum(sizes[j][e] for j in range(ep)) for e in range(local)]
    outputs = experts(torch.cat(by_expert), from_rank.sum(0), rows_per_expert)
    out_by_expert = outputs.split([sizes[j][e] for e in range(local) for j in range(ep)])
    back = torch.cat([out_by_expert[e * ep + j] for j in range(ep) for e in range(local)])
    return _AllToAll.apply(back, sent, received, axes.ep.group)


def apply_expert_parallel(model: nn.Module, axes: ExpertAxes) -> set[str]:
    """Keep this rank's n_experts / ep experts of every MoE layer (on the meta device) and route
    through the all-to-all. Returns the names of the expert parameters."""
    family = get_family(model.cfg.family)
    names = set()
    for name, module in list(model.named_modules()):
        placement = family.placement(name)
        if placement == "moe":
            module.dispatch = partial(expert_dispatch, axes)
        if placement != "stacked_experts":
            continue
        specs = getattr(module, "tp_specs", {})
        for leaf, param in list(module.named_parameters(recurse=False)):
            spec = specs.get(leaf, ShardSpec(tuple(param.shape)))
            specs[leaf] = replace(spec, cuts=((0, axes.ep.size, axes.ep.rank), *spec.cuts))
            with torch.device("meta"):
                setattr(module, leaf, nn.Parameter(torch.empty(param.shape[0] // axes.ep.size, *param.shape[1:])))
            names.add(f"{name}.{leaf}")
        module.tp_specs = specs
    return names


def set_capacity(model: nn.Module, capacity_factor: float | None) -> None:
    """Each MoE layer's capacity factor (None: dropless)."""
    family = get_family(model.cfg.family)
    for name, module in model.named_modules():
        if family.placement(name) == "moe":
            module.capacity_factor = capacity_factor


class ExpertSplit:
    """A ZeRO stage's strategy twice: over the dense parameters with the data-parallel group, over
    the experts' with the expert-data-parallel one. It answers what DataParallel asks of one strategy."""

    def __init__(self, dense_part: ShardingStrategy, expert_part: ShardingStrategy, expert_names: set[str]):
        self.dense_part, self.expert_part, self.expert_names = dense_part, expert_part, expert_names
        self.parts = (dense_part, expert_part)
        self.params = dense_part.params + expert_part.params
        self.stage = dense_part.stage
        self.grads_partitioned = dense_part.grads_partitioned
        self.reduce_every_micro_batch = dense_part.reduce_every_micro_batch
        self.offloaded = False  # ZeRO-Infinity is ZeRO-3's, which parallelize() runs without this split

    @contextmanager
    def backward(self, sync: bool, final: bool = True):
        with ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.backward(sync, final))
            yield

    def _joined(self, answers: Callable[[ShardingStrategy], list]) -> list:
        return [item for part in self.parts for item in answers(part)]

    def grad_pairs(self):
        return self._joined(lambda part: part.grad_pairs())

    def grad_norm_pairs(self):
        return self._joined(lambda part: part.grad_norm_pairs())

    def optimizer_pieces(self):
        """Matrices first, as each strategy orders its own: the optimizer's decayed group, then the
        rest (DataParallel.optimizer_param_groups), so its state i is piece i."""
        pieces = self._joined(lambda part: part.optimizer_pieces())
        return [pc for pc in pieces if pc[1].dim() >= 2] + [pc for pc in pieces if pc[1].dim() < 2]

    def stream_units(self):
        for part in self.parts:
            yield from part.stream_units()

    def reduce_all(self) -> None:
        for part in self.parts:
            part.reduce_all()

    def clip_(self, max_norm: float, total_norm: torch.Tensor) -> None:
        for part in self.parts:
            part.clip_(max_norm, total_norm)

    def prepare_step(self) -> None:
        for part in self.parts:
            part.prepare_step()

    def separate_optimizer_targets(self) -> None:
        for part in self.parts:
            part.separate_optimizer_targets()

    def after_step(self) -> None:
        for part in self.parts:
            part.after_step()

    def overlap_gathers(self, units) -> None:
        for part in self.parts:
            part.overlap_gathers(units)

    def wait_parameters(self) -> None:
        for part in self.parts:
            part.wait_parameters()

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def close(self) -> None:
        for part in self.parts:
            part.close()

    def stats(self) -> dict[str, int]:
        """Both parts' counters, summed (ZeRO-2 keeps each part's staging buffers)."""
        counters: dict[str, int] = {}
        for part in self.parts:
            for key, value in part.stats().items():
                counters[key] = counters.get(key, 0) + value
        return counters

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Each parameter as its own strategy holds it (ZeRO-1/2 gather their masters)."""
        state, experts = self.dense_part.full_state_dict(model), self.expert_part.full_state_dict(model)
        return {**state, **{name: experts[name] for name in self.expert_names}}

    @contextmanager
    def in_memory(self):
        with ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.in_memory())
            yield


def gather_experts(state: dict[str, torch.Tensor], specs: dict[str, ShardSpec], names: set[str],
                   axes: ExpertAxes) -> dict[str, torch.Tensor]:
    """Every expert of every layer on every rank of the expert-parallel group: each rank places its
    experts in the logical tensor (tensor parallelism's gather has placed its d_ff cut already, or
    there is none), the group sums."""
    full = dict(state)
    for name in names & state.keys():
        spec, tensor = specs[name], state[name]
        whole = tensor if tuple(tensor.shape) == spec.full_shape else None
        if whole is None:
            whole = tensor.new_zeros(spec.full_shape)
            whole[spec.box_slices()] = tensor
        whole = whole.clone()
        comm.all_reduce(whole, axes.ep.group, GROUP)
        full[name] = whole
    return full


def slice_experts(state: dict[str, torch.Tensor], specs: dict[str, ShardSpec]) -> dict[str, torch.Tensor]:
    """Logical tensors -> this rank's experts (and d_ff slice): the box of every cut tensor still
    whole (tensor parallelism's slicing took those it cuts)."""
    return {name: specs[name].local(t, 0, 1) if name in specs and specs[name].cuts and tuple(t.shape) ==
            specs[name].full_shape else t for name, t in state.items()}
