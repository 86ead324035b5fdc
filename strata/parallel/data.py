"""Data parallelism at any ZeRO stage, as the trainer, the optimizer and checkpoints see it.

`DataParallel` is composed of a sharding strategy, one per stage, each a `ShardingStrategy`
(strata/parallel/sharding.py; strata/parallel/gradients.py: `Replicate` for ZeRO-0,
`ShardOptimizerStates` for ZeRO-1, `ShardGradients` for ZeRO-2; strata/parallel/zero3.py:
`ShardParameters` for ZeRO-3), which owns where gradients and states live and how they are
reduced, and settings given when it is built (the process groups, the bucket size, the reduce and
gather dtypes). What every stage shares lives here: the backward context, the global gradient norm
and clipping, the tensor-parallel sums, what the optimizer and a checkpoint see.
With no process group it is the single-process case and never communicates."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from strata.distributed import comm
from strata.parallel.sharding import ShardingStrategy, tensor_bytes
from strata.parallel.tensor import ShardSpec, shard_specs
from strata.rules.constants import BUCKET_MB


@dataclass(frozen=True)
class DataParallelSettings:
    dp_group: object = None  # None: one process
    tp_group: object = None  # replicated parameters' partial gradients are summed over it
    pp_group: object = None  # pipeline stages hold different parameters: the norm sums over them too
    bucket_mb: float = BUCKET_MB
    reduce_dtype: torch.dtype | None = None  # what gradients travel in; None: their own (fp32 masters)
    gather_dtype: torch.dtype | None = None  # what ZeRO-3 gathers (and computes with); None: the masters'
    # id() of parameters another rank already counts (the last stage's copy of a tied embedding):
    # left out of the norm, and not written to checkpoints
    counted_elsewhere: frozenset[int] = frozenset()
    group_name: str = "dp"  # what the reductions are counted under ("edp": the experts' data-parallel group)
    # expert parallelism (strata/parallel/expert.py): id() of the expert parameters, which ranks of
    # the expert-parallel group hold disjoint parts of, and this rank's place among their replicas
    expert_ids: frozenset[int] = frozenset()
    ep_group: object = None
    edp_rank: int = 0
    # hybrid sharding: dp_group is then the shard group, and this the ranks holding the same shard
    # (the gradient shards are all-reduced over it after the reduce-scatters; None: flat ZeRO)
    replica_group: object = None
    # ZeRO-3 under a pipeline (pp_group set): keep the stage's units gathered through the step's
    # micro-batches and reduce-scatter once (Layout.reshard_after_forward off); else per micro-batch
    keep_gathered: bool = False

    @property
    def replica_size(self) -> int:
        return dist.get_world_size(self.replica_group) if self.replica_group is not None else 1

    @property
    def replica_rank(self) -> int:
        return dist.get_rank(self.replica_group) if self.replica_group is not None else 0

    @property
    def dp_size(self) -> int:
        return dist.get_world_size(self.dp_group) if self.dp_group is not None else 1

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(self.dp_group) if self.dp_group is not None else 0


class DataParallel:
    def __init__(self, model: nn.Module, sharding: ShardingStrategy, settings: DataParallelSettings,
                 activations=None):
        """sharding: the ZeRO stage's strategy, already holding the model's parameters.
        activations: the tier checkpointed activations are offloaded to (closed with the rest)."""
        self.model, self.sharding, self.settings, self.activations = model, sharding, settings, activations
        self.params = sharding.params
        sharding.overlap_gathers(gather_points(model))  # ZeRO-1/2's gathers waited for unit by unit
        specs = shard_specs(model)
        self._spec_of = {id(p): specs[name] for name, p in model.named_parameters()}
        self._norm_indices: dict[tuple, tuple[torch.Tensor, ...]] = {}  # see _norm_parts

    @property
    def stage(self) -> int:
        return self.sharding.stage

    @property
    def loss_factor(self) -> float:
        """What each rank's loss is multiplied by before backward so that the reductions, which
        sum, leave the average gradient over the data-parallel ranks: 1/dp (exact for powers of
        two). DDP divides while copying into its buckets; here no pass over the gradients does."""
        return 1.0 / (self.settings.dp_size * self.settings.replica_size)

    def spec_of(self, param: nn.Parameter) -> ShardSpec:
        """How tensor parallelism splits a parameter (replicated when not)."""
        return self._spec_of[id(param)]

    # --- backward ---------------------------------------------------------------------------------
    @contextmanager
    def backward(self, is_last_micro_batch: bool):
        """Wrap each micro-batch's backward; gradients are reduced after the last one (after every
        one under ZeRO-2/3)."""
        with self.sharding.backward(is_last_micro_batch or self.sharding.reduce_every_micro_batch, is_last_micro_batch):
            yield
        if is_last_micro_batch and not self.sharding.offloaded:  # offloaded: summed as they left
            self._sum_partial_grads_over_tp()
            self._sum_over_replicas()

    def reduce_gradients(self, embedding_group=None) -> None:
        """After a pipeline schedule, which ran every backward inside `backward(False)`: reduce
        the accumulated gradients now, every bucket at once (the schedule's last backwards are
        spread over chunks and ranks, so there is no one backward to overlap with).
        embedding_group: the first and last stage, whose copies of a tied embedding get the sum of
        their gradients: ZeRO-0/1/2 sum the whole gradient before the data-parallel reduction (ZeRO-2
        accumulates it whole under a pipeline); ZeRO-3 sums the reduced shards after it, the matrix
        being a unit of its own on both stages, sharded alike (1/dp of the bytes)."""
        tied = self.model.tied_weight() if embedding_group is not None else None
        if tied is not None and self.stage < 3:
            comm.all_reduce(tied.grad, embedding_group, "embedding")
        self.sharding.reduce_all()
        if tied is not None and self.stage == 3:
            shards = [g for g, p in self.sharding.grad_pairs() if p is tied]
            flat = torch.cat([g.reshape(-1) for g in shards])
            comm.all_reduce(flat, embedding_group, "embedding")
            for g, piece in zip(shards, flat.split([g.numel() for g in shards])):
                g.copy_(piece.view_as(g))
        self._sum_partial_grads_over_tp()
        self._sum_over_replicas()

    def _sum_over_replicas(self) -> None:
        """Hybrid sharding: this rank's gradient shards, reduced within its shard group, summed
        over the replicas holding the same shard: one all-reduce a step, after accumulation (the
        sums are linear), of 1/shards of the gradients, in the reduce dtype (HSDP's second level)."""
        group = self.settings.replica_group
        if group is None:
            return
        grads = [g for g, _ in self.sharding.grad_pairs()]
        flat = torch.cat([g.reshape(-1).to(self.settings.reduce_dtype or g.dtype) for g in grads])
        comm.all_reduce(flat, group, "dp_replicate")
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def _sum_partial_grads_over_tp(self) -> None:
        """Parameters that each tensor-parallel rank saw only part of (norms under sequence
        parallelism, K/V projections shared by ranks; under a grid, vectors applied to each rank's
        own sequences and 2.5-D's weight copies, over their own sub-group): sum their gradients,
        one all-reduce per group, once a step (the sums are linear, so after accumulation)."""
        by_group: dict[str, tuple[object, list[torch.Tensor]]] = {}
        for g, p in self.sharding.grad_pairs():
            spec = self.spec_of(p)
            if not spec.partial_grad:
                continue
            axis = spec.sum_over
            group, name = (axis.group, axis.name) if axis is not None else (self.settings.tp_group, "tp")
            if group is not None:
                by_group.setdefault(name, (group, []))[1].append(g)
        for name, (group, grads) in by_group.items():
            flat = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce(flat, group, name)
            for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(piece.view_as(g))

    # --- the update -------------------------------------------------------------------------------
    def local_grads(self) -> list[torch.Tensor]:
        return [g for g, _ in self.sharding.grad_pairs()]

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the averaged gradient: the squares of `grad_squares`, summed over
        the pipeline stages."""
        total = self.grad_squares()
        if self.settings.pp_group is not None:
            comm.all_reduce(total, self.settings.pp_group, "pp")
        return total.sqrt().to(self.grad_dtype)

    @property
    def grad_dtype(self) -> torch.dtype:
        grads = self.local_grads()
        return grads[0].dtype if grads else self.params[0].dtype  # the masters' gradients' dtype

    def grad_squares(self) -> torch.Tensor:
        """This pipeline stage's sum of squared gradient elements (fp64, 0-dim): over what this rank
        holds, over the dp ranks when they hold disjoint parts (ZeRO), over the tp ranks for
        tensor-parallel slices (replicated parameters count once)."""
        settings = self.settings
        pairs = [(n, p) for n, p in self.sharding.grad_norm_pairs() if id(p) not in settings.counted_elsewhere]
        squares = torch.zeros(2, dtype=torch.float64, device=self.params[0].device)  # (tp-split, replicated)
        experts = torch.zeros(1, dtype=torch.float64, device=self.params[0].device)
        if pairs:
            norms = torch.stack([n for n, _ in pairs]).double()
            split, replicated, expert = self._norm_parts([p for _, p in pairs], norms.device)
            squares[0] = norms.index_select(0, split).square().sum()
            squares[1] = norms.index_select(0, replicated).square().sum()
            experts[0] = norms.index_select(0, expert).square().sum()
        if settings.expert_ids:
            # the expert-parallel ranks hold different experts; under ZeRO the dp reduction below
            # covers them (ep x edp = dp, every part disjoint), else their replicas are alike
            if self.stage == 0 and settings.ep_group is not None:
                comm.all_reduce(experts, settings.ep_group, "ep")
            squares[0] += experts[0]  # split by tp like an MLP, when tp > 1
        if self.sharding.grads_partitioned and settings.dp_group is not None:  # each dp rank holds a disjoint part
            comm.all_reduce(squares, settings.dp_group, settings.group_name)
        if settings.tp_group is not None:
            split = squares[:1].clone()
            comm.all_reduce(split, settings.tp_group, "tp")
            squares[0] = split[0]
        return squares.sum()

    def _norm_parts(self, params: list, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The positions, among `params`, of the tensor-parallel slices this rank counts (a block
        several tp ranks hold, under multi-dimensional tp, by its owner only), of the replicated
        parameters, and of the experts: index tensors made on the device once per parameter list
        (a boolean mask would make the host read the device on every step to size its result)."""
        key = tuple(id(p) for p in params)
        if key not in self._norm_indices:
            expert = [id(p) in self.settings.expert_ids for p in params]
            specs = [self.spec_of(p) for p in params]
            rows = ([i for i, s in enumerate(specs) if s.split and s.owner and not expert[i]],
                    [i for i, s in enumerate(specs) if not s.split and not expert[i]],
                    [i for i in range(len(params)) if expert[i]])
            self._norm_indices[key] = tuple(torch.tensor(r, dtype=torch.long, device=device) for r in rows)
        return self._norm_indices[key]

    def clip_(self, max_norm: float, total_norm: torch.Tensor) -> None:
        self.sharding.clip_(max_norm, total_norm)

    def optimizer_pieces(self) -> list[tuple[torch.Tensor, nn.Parameter, int, int]]:
        """What the optimizer updates, in its order: (tensor, the parameter it is part of, its
        flat range [lo, hi) in that parameter)."""
        return self.sharding.optimizer_pieces()

    def optimizer_param_groups(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(tensors with weight decay, tensors without): matrices and embeddings decay, norms and
        biases do not."""
        pieces = self.optimizer_pieces()
        return [t for t, p, _, _ in pieces if p.dim() >= 2], [t for t, p, _, _ in pieces if p.dim() < 2]

    def prepare_step(self) -> None:
        """Just before the optimizer step: see `Replicate.separate_optimizer_targets`."""
        self.sharding.prepare_step()

    def after_step(self) -> None:
        """After the optimizer step (and after loading a checkpoint): ZeRO-1/2 gather every rank's
        updated shard into the parameters."""
        self.sharding.after_step()

    def zero_grad(self) -> None:
        self.sharding.zero_grad()

    # --- what is held and saved ---------------------------------------------------------------------
    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Model-state bytes this rank holds, counted from the tensors (padding not included)."""
        held = self.sharding.stats()
        return {"params": held["params_bytes"], "grads": held["grads_bytes"],
                "optimizer": optimizer_state_bytes(optimizer)}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The logical model's tensors on this rank (ZeRO-3 gathers them a unit at a time)."""
        return self.sharding.full_state_dict(self.model)

    def in_memory(self):
        """A context in which offloaded parameter shards are in memory (a checkpoint reads or
        writes them); a no-op for every other stage."""
        return self.sharding.in_memory()

    def close(self) -> None:
        """Remove the offload tiers' files."""
        self.sharding.close()
        if self.activations is not None:
            self.activations.tier.close()

    def writes(self, param: nn.Parameter, tp_rank: int) -> bool:
        """Whether this rank writes its piece of `param` to a checkpoint, so that every element is
        written once: replicas (the dp ranks under ZeRO-0, the tp ranks of a replicated parameter,
        a tied embedding's second copy) by one rank only."""
        spec = self.spec_of(param)
        written = spec.owner if spec.cuts else (spec.dim is not None or tp_rank == 0)
        replica = self.settings.edp_rank if id(param) in self.settings.expert_ids else self.settings.dp_rank
        return ((self.stage > 0 or replica == 0) and written and self.settings.replica_rank == 0
                and id(param) not in self.settings.counted_elsewhere)


def gather_points(model: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Per unit of the model (the inputs, each block, the outputs: ZeRO-3's), the module its
    forward enters first and the parameters it reads: a tied head reads the embedding's matrix."""
    points, units = [], model.units()
    for i, modules in enumerate(units):
        params = [p for m in modules for p in m.parameters()]
        if i == len(units) - 1 and model.tied_weight() is not None:
            params.append(model.tied_weight())
        if modules:
            points.append((modules[0], params))
    return points


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The optimizer's per-element states (Adam's moments); its 0-dim step counters are left out,
    a few bytes per tensor that no formula of the field counts."""
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0)
