"""Tensor parallelism, Megatron-style 1-D (Shoeybi et al. 2019), with sequence parallelism
(Korthikanti et al. 2022), applied to strata's plain model by swapping its layers.

In each block the attention projections q, k, v and the MLP's first matrices are column-parallel
(each rank computes a slice of the heads / of d_ff), the output projections are row-parallel (each
rank holds a slice of the input features and the partial results are summed). The input of every
column-parallel group passes through one `copy_to_tp` (identity forward, all-reduce backward),
placed on the norm before it, so q, k and v share one collective; each row-parallel output through
one all-reduce. So a block communicates 2 all-reduces of b·s·h forward and 2 backward.

With sequence parallelism the regions between blocks (norms, residuals) hold 1/t of the sequence:
the norm's copy becomes an all-gather of the sequence, the row-parallel all-reduce a reduce-scatter
(same volume), and the norm weights, which now see 1/t of the tokens, have their gradients summed
over the group.

The vocabulary is split across ranks (embedding and head), padded to a multiple of t with rows
that can never win: the cross-entropy masks the padded logits to -inf, so the loss is that of the
unpadded model. The loss is computed without gathering the logits (Megatron's vocab-parallel
cross-entropy: max, sum of exponentials and target logit are all-reduced, N numbers each).

Grouped-query attention with fewer KV heads than ranks keeps the K and V projections whole on every
rank; each rank uses the rows of the KV head its query heads read, and the gradients are summed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from strata.distributed import comm
from strata.model.families import get_family
from strata.parallel import tensor_comm as tpc
from strata.parallel.tensor_norms import ProjectionNorm, keep_rows_after
from strata.rules.tensor_modes import grid_of, padded_vocab


@dataclass(frozen=True)
class ShardSpec:
    """How a parameter relates to the logical (single-device) one."""
    full_shape: tuple[int, ...]
    dim: int | None = None  # split along this dim over the TP ranks; None: replicated
    padded: int | None = None  # the full size along `dim` (dim 0 with cuts) after padding (vocabulary)
    partial_grad: bool = False  # replicated, but each rank's gradient is a part: sum over TP
    sum_over: object = None  # with partial_grad: the grid axis to sum over (tensor_nd.py); None: the TP group
    # Multi-dimensional tensor parallelism (tensor_nd.py): this rank's block, as (dim, parts, index)
    # cuts of the (padded) logical tensor, and whether this rank is the block's owner (the one of
    # its copies that is written and counted in the gradient norm).
    cuts: tuple[tuple[int, int, int], ...] = ()
    owner: bool = True

    @property
    def split(self) -> bool:
        """Whether ranks hold different parts of the tensor (else each holds all of it)."""
        return self.dim is not None or bool(self.cuts)

    def _padded(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        if self.padded and self.padded > full.shape[dim]:
            pad_shape = list(full.shape)
            pad_shape[dim] = self.padded - full.shape[dim]
            full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
        return full

    def local(self, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        if self.cuts:
            return self._padded(full, 0)[self.box_slices()].clone()
        if self.dim is None:
            return full
        return self._padded(full, self.dim).chunk(world, dim=self.dim)[rank].clone()

    def local_box(self, rank: int, world: int) -> list[tuple[int, int]]:
        """This rank's block of the (padded) logical tensor, as `local` cuts it: (start, end) per
        dimension, an end past the logical shape in a padded vocabulary's rows."""
        if self.cuts:
            return self.box_bounds()
        bounds = [(0, n) for n in self.full_shape]
        if self.dim is not None:
            length = self.padded if self.padded and self.padded > self.full_shape[self.dim] else \
                self.full_shape[self.dim]
            size = -(-length // world)  # torch.chunk's
            start = min(rank * size, length)
            bounds[self.dim] = (start, min(start + size, length))
        return bounds

    def box_slices(self) -> tuple[slice, ...]:
        """The block `cuts` keeps, as slices of the padded logical tensor."""
        return tuple(slice(start, end) for start, end in self.box_bounds())

    @property
    def padded_shape(self) -> tuple[int, ...]:
        """The logical shape with a cut tensor's vocabulary padding (dim 0)."""
        return (self.padded, *self.full_shape[1:]) if self.cuts and self.padded else self.full_shape

    def box_bounds(self) -> list[tuple[int, int]]:
        """Per dimension, [start, end) of the block `cuts` keeps (end may pass the unpadded size)."""
        shape = list(self.padded_shape)
        bounds = [(0, n) for n in shape]
        for dim, parts, index in self.cuts:
            length = shape[dim] // parts
            bounds[dim] = (index * length, (index + 1) * length)
        return bounds


def _tp(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


class ColumnParallelLinear(nn.Module):
    """y = x A^T with A's rows (output features) split; the input conversion is done by the caller."""

    def __init__(self, full_in: int, full_out: int, bias: bool, group, padded_out: int | None = None):
        super().__init__()
        rank, world = _tp(group)
        out = (padded_out or full_out) // world
        self.weight = nn.Parameter(torch.empty(out, full_in))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None
        self.tp_specs = {"weight": ShardSpec((full_out, full_in), 0, padded_out)}
        if bias:
            self.tp_specs["bias"] = ShardSpec((full_out,), 0, padded_out)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r A_r^T, A's columns (input features) split; bias added once, after."""

    def __init__(self, full_in: int, full_out: int, bias: bool, group, sequence_parallel: bool):
        super().__init__()
        rank, world = _tp(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(full_out, full_in // world))
        self.bias = nn.Parameter(torch.empty(full_out)) if bias else None
        self.tp_specs = {"weight": ShardSpec((full_out, full_in), 1)}
        if bias:  # with sequence parallelism each rank adds it to its own tokens only
            self.tp_specs["bias"] = ShardSpec((full_out,), None, partial_grad=sequence_parallel)

    def forward(self, x):
        y = F.linear(x, self.weight)
        y = tpc.scatter_seq(y, self.group) if self.sequence_parallel else tpc.reduce_from_tp(y, self.group)
        return y + self.bias if self.bias is not None else y


class ReplicatedKVLinear(nn.Module):
    """K or V projection when there are fewer KV heads than ranks: the whole weight on every rank,
    of which this rank uses the rows of the KV heads its query heads attend with."""

    def __init__(self, full_in: int, n_kv_heads: int, head_dim: int, bias: bool, kv_heads_used: range):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_kv_heads * head_dim, full_in))
        self.bias = nn.Parameter(torch.empty(n_kv_heads * head_dim)) if bias else None
        self.rows = slice(kv_heads_used.start * head_dim, kv_heads_used.stop * head_dim)
        self.tp_specs = {"weight": ShardSpec(tuple(self.weight.shape), None, partial_grad=True)}
        if bias:
            self.tp_specs["bias"] = ShardSpec(tuple(self.bias.shape), None, partial_grad=True)

    def forward(self, x):
        bias = self.bias[self.rows] if self.bias is not None else None
        return F.linear(x, self.weight[self.rows], bias)


class VocabParallelEmbedding(nn.Module):
    """Rows [r·V'/t, (r+1)·V'/t) of the (padded) table on rank r; a token outside them looks up
    zeros here and is supplied by its owner through the all-reduce."""

    def __init__(self, vocab: int, dim: int, group, padded_vocab: int):
        super().__init__()
        rank, world = _tp(group)
        self.group = group
        rows = padded_vocab // world
        self.start, self.end = rank * rows, (rank + 1) * rows
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.tp_specs = {"weight": ShardSpec((vocab, dim), 0, padded_vocab)}

    def forward(self, tokens):
        outside = (tokens < self.start) | (tokens >= self.end)
        local = (tokens - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)
        return tpc.reduce_from_tp(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, start, vocab, group, name=tpc.GROUP):
        """logits: (N, V'/t) this rank's columns; targets: (N,) global ids. Returns (N,) losses."""
        columns = torch.arange(start, start + logits.shape[-1], device=logits.device)
        logits = logits.masked_fill(columns >= vocab, float("-inf"))  # padding never counts
        maximum = logits.max(dim=-1).values
        comm.all_reduce(maximum, group, name, op=dist.ReduceOp.MAX)
        shifted = logits - maximum[:, None]
        mine = (targets >= start) & (targets < start + logits.shape[-1])
        local_target = (targets - start).masked_fill(~mine, 0)
        target_logit = shifted.gather(1, local_target[:, None])[:, 0].masked_fill(~mine, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        both = torch.stack([target_logit, sum_exp])  # one all-reduce for the two sums
        comm.all_reduce(both, group, name)
        target_logit, sum_exp = both[0], both[1]
        softmax = exp / sum_exp[:, None]
        ctx.save_for_backward(softmax, local_target, mine)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, mine = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= mine.to(grad.dtype)
        return grad * grad_loss[:, None], None, None, None, None, None


def vocab_parallel_losses(logits, targets, start: int, vocab: int, group, name: str = tpc.GROUP) -> torch.Tensor:
    """Each token's cross-entropy from logits whose columns [start, start + width) of the padded
    vocabulary this rank holds (the others over `group`), never gathering them."""
    if logits.dtype in (torch.float16, torch.bfloat16):  # the softmax sums want fp32
        logits = logits.float()
    return _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), start, vocab,
                                            group, name)


class VocabParallelCrossEntropy(nn.Module):
    """Mean cross-entropy over tokens from vocabulary-split logits, never gathering them."""

    def __init__(self, vocab: int, padded_vocab: int, group):
        super().__init__()
        rank, world = _tp(group)
        self.vocab, self.start, self.group = vocab, rank * padded_vocab // world, group

    def forward(self, logits, targets):
        return self.token_losses(logits, targets).mean()

    def token_losses(self, logits, targets):
        """Each token's loss (a chunk of the sequence at a time: strata/model/loss.py)."""
        return vocab_parallel_losses(logits, targets, self.start, self.vocab, self.group)

    def mean(self, total, targets):
        return total / targets.numel()


class SplitSequence(nn.Module):
    """Sequence parallelism's entry: this rank's 1/t of the sequence (all-gather in backward)."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, h):
        return tpc.split_seq(h, self.group)


class GatherLogits(nn.Module):
    """For generation: the full logits on every rank (all-gather over the vocabulary), unpadded."""

    def __init__(self, vocab: int, group):
        super().__init__()
        self.vocab, self.group = vocab, group

    def forward(self, logits):
        world = dist.get_world_size(self.group)
        local = logits.movedim(-1, 0).contiguous()
        full = local.new_empty((local.shape[0] * world, *local.shape[1:]))
        comm.all_gather(full, local, self.group, tpc.GROUP)
        return full.movedim(0, -1)[..., :self.vocab]


# --- applying it to the model ------------------------------------------------------------------
def apply_tensor_parallel(model: nn.Module, group, sequence_parallel: bool = False) -> None:
    """Swap the layers of strata's Transformer (built on the meta device) for tensor-parallel ones,
    each as its family's description places it (PLACEMENTS in strata/model/families/base.py);
    their `tp_specs` say how each parameter is cut from the logical one."""
    cfg = model.cfg
    family = get_family(cfg.family)
    rank, world = _tp(group)
    split = _Splitter(cfg, group, sequence_parallel)
    with torch.device("meta"):
        for name, module in list(model.named_modules()):
            placement = family.placement(name)
            if placement is not None:
                replacement = split(placement, module)
                if replacement is not module:
                    model.set_submodule(name, replacement)
        model.criterion = VocabParallelCrossEntropy(cfg.vocab_size, split.padded_vocab, group)
        model.gather_logits = GatherLogits(cfg.vocab_size, group)
    heads = cfg.n_heads // world
    model.keep_heads(range(rank * heads, (rank + 1) * heads))
    if sequence_parallel:  # blocks run on this rank's slice of the sequence
        model.to_blocks = SplitSequence(group)
        _keep_shards_for_backward(model, split.saver)


class _Splitter:
    """placement, single-device module -> its tensor-parallel replacement (or the module itself,
    marked), for one model and group."""

    def __init__(self, cfg, group, sequence_parallel: bool):
        self.cfg, self.group, self.sequence_parallel = cfg, group, sequence_parallel
        self.rank, self.world = _tp(group)
        self.padded_vocab = padded_vocab(cfg.vocab_size, grid_of("1d", self.world))
        self.saver = tpc.SequenceParallelSaver(group) if sequence_parallel else None

    def __call__(self, placement: str, module: nn.Module) -> nn.Module:
        return getattr(self, placement)(module)

    def vocabulary(self, module):
        if isinstance(module, nn.Embedding):
            return VocabParallelEmbedding(module.num_embeddings, module.embedding_dim, self.group, self.padded_vocab)
        return ColumnParallelLinear(module.in_features, module.out_features, module.bias is not None, self.group,
                                    self.padded_vocab)

    def column(self, module):
        return ColumnParallelLinear(module.in_features, module.out_features, module.bias is not None, self.group)

    def kv_column(self, module, every_head: bool = False):
        cfg = self.cfg
        if cfg.kv_heads % self.world == 0:
            return self.column(module)
        # fewer KV heads than ranks: keep K and V whole, use the KV heads this rank's query heads read
        # (or every one, for a norm after it that reads them all: normed_kv_column)
        return ReplicatedKVLinear(module.in_features, cfg.kv_heads, cfg.head_dim, module.bias is not None,
                                  range(cfg.kv_heads) if every_head else self._kv_heads_used())

    def _kv_heads_used(self) -> range:
        """The KV heads this rank's query heads read (with fewer KV heads than ranks)."""
        cfg = self.cfg
        q_per_rank, q_per_kv = cfg.n_heads // self.world, cfg.n_heads // cfg.kv_heads
        return range(self.rank * q_per_rank // q_per_kv, (self.rank * q_per_rank + q_per_rank - 1) // q_per_kv + 1)

    def normed_kv_column(self, module):
        return self.kv_column(module, every_head=True)

    def output_norm(self, module):
        if self.sequence_parallel:
            _partial_gradients(module)  # it sees 1/t of the tokens
        return module

    def projection_norm(self, module):
        width = module.weight.shape[0]
        return ProjectionNorm(width, module.eps, self.cfg.norm == "gemma_rmsnorm", self.group, ShardSpec((width,), 0))

    def kv_projection_norm(self, module):
        if self.cfg.kv_heads % self.world == 0:
            return self.projection_norm(module)
        used, head_dim = self._kv_heads_used(), self.cfg.head_dim
        keep_rows_after(module, slice(used.start * head_dim, used.stop * head_dim))
        _partial_gradients(module)  # each rank's heads' part of it
        return module

    def row(self, module):
        return RowParallelLinear(module.in_features, module.out_features, module.bias is not None, self.group,
                                 self.sequence_parallel)

    def input_norm(self, module):
        # the input conversion of the column-parallel group this norm feeds: one per group
        if self.sequence_parallel:
            module.register_forward_hook(lambda m, args, out: tpc.gather_seq(out, self.group, self.saver))
            _partial_gradients(module)  # it sees 1/t of the tokens
        else:
            module.register_forward_hook(lambda m, args, out: tpc.copy_to_tp(out, self.group))
        return module

    def head_norm(self, module):
        _partial_gradients(module)  # it sees this rank's heads only
        return module

    summed_replica = head_norm  # (MLA's down projections: whole, feeding this rank's heads only)

    def replicated(self, module):
        return module

    def moe(self, module):
        module.whole_gradient = lambda w: tpc.copy_to_tp(w, self.group)
        module.reduce_partial = lambda y: tpc.reduce_from_tp(y, self.group)
        module.replicated_input = lambda x: tpc.scale_gradient(x, 1.0 / self.world)
        return module

    def stacked_experts(self, module):
        """Each expert's d_ff split as an MLP's (module.d_ff_dims), as cuts: expert parallelism adds its own."""
        specs = {}
        for name, param in list(module.named_parameters(recurse=False)):
            dim = module.d_ff_dims[name]
            shape = list(param.shape)
            specs[name] = ShardSpec(tuple(shape), cuts=((dim, self.world, self.rank),))
            shape[dim] //= self.world
            setattr(module, name, nn.Parameter(torch.empty(shape)))
        module.tp_specs = specs
        return module


def _partial_gradients(module: nn.Module) -> None:
    """A replicated module whose gradient on each rank is a part of the whole: summed over the group."""
    module.tp_specs = {name: ShardSpec(tuple(p.shape), None, partial_grad=True)
                       for name, p in module.named_parameters()}


def _keep_shards_for_backward(model: nn.Module, saver: "tpc.SequenceParallelSaver") -> None:
    """Install the saver's saved-tensor hooks for the length of each forward of the model."""
    active = []

    def enter(module, args):
        hooks = torch.autograd.graph.saved_tensors_hooks(saver.pack, saver.unpack)
        hooks.__enter__()
        active.append(hooks)

    def leave(module, args, output):
        active.pop().__exit__(None, None, None)
        saver.end_forward()

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave)


def shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """Each parameter's ShardSpec by its full name; parameters of unswapped layers are replicated."""
    specs = {}
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            specs[full] = getattr(module, "tp_specs", {}).get(name, ShardSpec(tuple(param.shape)))
    return specs


def gather_tensor_parallel(state: dict[str, torch.Tensor], specs: dict[str, ShardSpec], group) -> dict:
    """This rank's slices -> the logical tensors (every rank of the group calls it)."""
    world = dist.get_world_size(group)
    full = {}
    for name, tensor in state.items():
        spec = specs.get(name)
        if spec is not None and spec.cuts:  # a grid block: each owner places its block, the group sums
            whole = tensor.new_zeros(spec.padded_shape)
            if spec.owner:
                whole[spec.box_slices()] = tensor
            comm.all_reduce(whole, group, tpc.GROUP)
            full[name] = whole[tuple(slice(0, n) for n in spec.full_shape)].clone()
            continue
        if spec is None or spec.dim is None:
            full[name] = tensor
            continue
        flat = tensor.new_empty(world * tensor.numel())
        comm.all_gather(flat, tensor.contiguous().reshape(-1), group, tpc.GROUP)
        parts = flat.view(world, *tensor.shape).unbind(0)
        full[name] = torch.cat(parts, dim=spec.dim).narrow(spec.dim, 0, spec.full_shape[spec.dim]).clone()
    return full


def slice_tensor_parallel(state: dict[str, torch.Tensor], specs: dict[str, ShardSpec], group) -> dict:
    """Logical tensors -> this rank's slices."""
    rank, world = _tp(group)
    return {name: specs[name].local(t, rank, world) if name in specs else t for name, t in state.items()}
