"""Multi-dimensional tensor parallelism (Colossal-AI's 2-D, 2.5-D and 3-D; the grids and their
formulas are in strata/rules/tensor_modes.py), applied to strata's plain model by swapping its
layers, as 1-D's strata/parallel/tensor.py does.

Between layers a rank holds 1/|B| of the micro-batch's sequences and 1/q of the hidden features.
Every linear layer is one autograd function (`_GridLinear`) of three collectives: the input block
gathered over one group, the weight block over another, and (3-D) the output reduce-scattered over
a third; its backward gathers input and weight again, so that only the local blocks are kept for
backward (what SUMMA's re-broadcast in backward does), and reduce-scatters their gradients. The
attention core, the activations and the residuals work on local heads and local sequences: the
sequence itself is never split, so attention needs no communication.

  2-D / 2.5-D  input gathered along its features over the row, the weight along its input
               features over the column (SUMMA's q broadcast steps, as one all-gather each);
               2.5-D's d layers each hold a copy of the weights and sum their gradients.
  3-D          input gathered along the batch over x, weight along its input features over w,
               output reduce-scattered along the batch over y (Bian et al.'s Algorithm 1); the
               output's features are split along what was the batch axis, so the next layer
               (the output projections) runs with i and j swapped, and each block ends where it began.

Norms split the features too: their statistics are all-reduced over the row (forward, and the
statistics' gradient backward). A vector parameter (norm weight, bias) is held by every rank of
the group whose sequences differ; its gradient is summed over that group inside the backward
(`_sum_grad`), so the parameters' gradients are complete when backward ends and data
parallelism sees plain parameters.

The embedding is split by vocabulary over the sequence group and by features over the row: each
rank looks every token up in its rows, and a reduce-scatter over the sequence group hands each rank
its sequences' sum. The head is a linear layer; the loss is Megatron's vocabulary-parallel
cross-entropy over the row, averaged over the sequence groups."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from strata.distributed import comm
from strata.distributed.mesh import Axis
from strata.errors import ConfigError
from strata.model.families import get_family
from strata.parallel.tensor import ShardSpec, vocab_parallel_losses
from strata.parallel.tensor_comm import conjugate
from strata.rules.tensor_modes import TensorGrid, coordinates, padded_vocab
from strata.rules.tensor_traffic import grid_roles


class GridGroups:
    """This rank's place on the grid and its sub-groups (built by strata/distributed/mesh.py)."""

    def __init__(self, grid: TensorGrid, t: int, axes: dict[str, Axis]):
        self.grid, self.t, self.axes = grid, t, axes
        self.at = coordinates(grid, t)

    def __getitem__(self, name: str) -> Axis | None:
        return self.axes.get(name)


# --- the collectives, along any dimension ----------------------------------------------------------
def _gather(x: torch.Tensor, axis: Axis | None, dim: int) -> torch.Tensor:
    if axis is None or axis.size == 1:
        return x
    local = x.movedim(dim, 0).contiguous()
    out = local.new_empty((local.shape[0] * axis.size, *local.shape[1:]))
    comm.all_gather(out, local, axis.group, axis.name)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, axis: Axis | None, dim: int) -> torch.Tensor:
    if axis is None or axis.size == 1:
        return x
    full = x.movedim(dim, 0).contiguous()
    out = full.new_empty((full.shape[0] // axis.size, *full.shape[1:]))
    comm.reduce_scatter(out, full, axis.group, axis.name)
    return out.movedim(0, dim)


def _all_reduce(x: torch.Tensor, axis: Axis | None) -> torch.Tensor:
    if axis is None or axis.size == 1:
        return x
    x = x.contiguous()
    comm.all_reduce(x, axis.group, axis.name)
    return x


def _size(axis: Axis | None) -> int:
    return axis.size if axis is not None else 1


# The conjugate pairs (forward, backward) over a grid axis:
#   _sum_both_ways   all-reduce / all-reduce: a norm's statistics over features split along the axis
#   _scatter_batch   reduce-scatter / all-gather along the batch
#   _gather_batch    all-gather / reduce-scatter along the batch
#   _mean_over       the mean of each rank's part over the axis / each part's 1/size share
_sum_both_ways = conjugate("SumBothWays", lambda x, axis: _all_reduce(x.clone(), axis),
                           lambda grad, axis: _all_reduce(grad.clone(), axis))
_scatter_batch = conjugate("ScatterBatch", lambda x, axis: _reduce_scatter(x, axis, 0),
                           lambda grad, axis: _gather(grad, axis, 0))
_gather_batch = conjugate("GatherBatch", lambda x, axis: _gather(x, axis, 0),
                          lambda grad, axis: _reduce_scatter(grad, axis, 0))
_mean_over = conjugate("MeanOver", lambda x, axis: _all_reduce(x.clone(), axis) / _size(axis),
                       lambda grad, axis: grad / _size(axis))
# compiled blocks (--compile) call the collectives as they are: torch.compile leaves them out of its graphs
_linear = torch.compiler.disable(lambda *a: _GridLinear.apply(*a))


def _partial(axis: Axis | None) -> dict:
    """ShardSpec fields of a tensor that every rank of `axis` holds and applies to its own part
    (its sequences, its depth layer's): its gradient is summed over the axis once a step."""
    return {"partial_grad": True, "sum_over": axis} if axis is not None and axis.size > 1 else {}


@dataclass(frozen=True)
class LinearPlan:
    """The groups one linear layer's collectives run over: x (its input gathered along x_dim:
    -1 features, 0 batch), w (its weight along input features), y (its output reduce-scattered
    along the batch, or None), copies (ranks holding the same weight block, whose gradients are
    summed), bias (ranks adding the same bias to other sequences)."""
    x: Axis | None
    x_dim: int
    w: Axis | None
    y: Axis | None
    copies: Axis | None
    bias: Axis | None


class _GridLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, plan: LinearPlan):
        # under autocast the blocks travel and multiply in the autocast dtype (half the bytes)
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        ctx.plan, ctx.dtype = plan, dtype
        ctx.save_for_backward(x, weight)  # the local blocks only: backward gathers them again
        with torch.autocast(device, enabled=False):
            x_full = _gather(x.to(dtype), plan.x, plan.x_dim)
            w_full = _gather(weight.to(dtype), plan.w, 1)
            y = F.linear(x_full, w_full)
        return _reduce_scatter(y, plan.y, 0) if plan.y is not None else y

    @staticmethod
    def backward(ctx, grad):
        plan, dtype = ctx.plan, ctx.dtype
        x, weight = ctx.saved_tensors
        grad = grad.to(dtype)
        if plan.y is not None:
            grad = _gather(grad, plan.y, 0)
        x_full = _gather(x.to(dtype), plan.x, plan.x_dim)
        w_full = _gather(weight.to(dtype), plan.w, 1)
        grad_x = _reduce_scatter(grad @ w_full, plan.x, plan.x_dim).to(x.dtype)
        grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x_full.reshape(-1, x_full.shape[-1])
        # the weight's gradient summed over the sequence groups in the weight's dtype, as data
        # parallelism sums it (fp32 under bf16 autocast)
        return grad_x, _reduce_scatter(grad_w.to(weight.dtype), plan.w, 1), None


class GridLinear(nn.Module):
    """A linear layer cut over the grid: weight (out/q, in/parts) of the logical (out, in)."""

    def __init__(self, full_in: int, full_out: int, bias: bool, plan: LinearPlan, out_index: int, out_parts: int,
                 in_index: int, in_parts: int, owner: bool, padded_out: int | None = None):
        super().__init__()
        out = (padded_out or full_out) // out_parts
        self.plan = plan
        self.weight = nn.Parameter(torch.empty(out, full_in // in_parts))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None
        cut_out = (0, out_parts, out_index)
        self.tp_specs = {"weight": ShardSpec((full_out, full_in), padded=padded_out,
                                             cuts=(cut_out, (1, in_parts, in_index)), owner=owner,
                                             **_partial(plan.copies))}
        if bias:  # the bias's owner: the first of the ranks that add it (plan.bias rank 0)
            self.tp_specs["bias"] = ShardSpec((full_out,), padded=padded_out, cuts=(cut_out,),
                                              owner=plan.bias is None or plan.bias.rank == 0, **_partial(plan.bias))

    def forward(self, x):
        y = _linear(x, self.weight, self.plan)
        return y + self.bias.to(y.dtype) if self.bias is not None else y


def norm_from_statistics(x: torch.Tensor, weight, bias, kind: str, eps: float, width: int, total) -> torch.Tensor:
    """A norm over the last dimension, `width` features in all of which x holds some; `total`
    turns per-token partial sums into whole ones (identity when x holds every feature)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    h = x.to(compute)
    if kind == "layernorm":  # two passes: the mean, then the squares about it (E[x²] - mean² cancels)
        centred = h - (total(h.sum(-1, keepdim=True)) / width)
        var = total(centred.pow(2).sum(-1, keepdim=True)) / width
        out = centred * torch.rsqrt(var + eps)
        out = out * weight.to(compute) + bias.to(compute)
        return out.to(x.dtype)
    rstd = torch.rsqrt(total(h.pow(2).sum(-1, keepdim=True)) / width + eps)
    if kind == "gemma_rmsnorm":
        return (h * rstd * (1.0 + weight.to(compute))).to(x.dtype)
    return ((h * rstd).to(x.dtype) * weight.to(x.dtype))


class GridNorm(nn.Module):
    """A norm over features split along `row`: statistics summed over it, the weight (and bias)
    this rank's features' slice, partial on each rank of `batch` (which holds other sequences)."""

    def __init__(self, norm: nn.Module, kind: str, row: Axis, batch: Axis | None, index: int, parts: int):
        super().__init__()
        width = norm.weight.shape[0]
        self.kind, self.eps, self.width, self.row = kind, norm.eps, width, row
        self.weight = nn.Parameter(torch.empty(width // parts))
        self.bias = nn.Parameter(torch.empty(width // parts)) if getattr(norm, "bias", None) is not None else None
        spec = ShardSpec((width,), cuts=((0, parts, index),), owner=batch is None or batch.rank == 0, **_partial(batch))
        self.tp_specs = {"weight": spec, **({"bias": spec} if self.bias is not None else {})}

    def forward(self, x):
        return norm_from_statistics(x, self.weight, self.bias, self.kind, self.eps, self.width,
                                    lambda s: _sum_both_ways(s, self.row))


class GridHeadNorm(nn.Module):
    """A norm over each head's own features (Qwen3's q/k norms): every rank holds it whole and uses
    it on its heads and sequences, so its gradient is partial on every rank of the group."""

    def __init__(self, norm: nn.Module, kind: str, group: Axis):
        super().__init__()
        self.kind, self.eps = kind, norm.eps
        self.weight = nn.Parameter(torch.empty_like(norm.weight))
        self.tp_specs = {"weight": ShardSpec(tuple(norm.weight.shape), **_partial(group))}

    def forward(self, x):
        return norm_from_statistics(x, self.weight, None, self.kind, self.eps, x.shape[-1], lambda s: s)


class GridEmbedding(nn.Module):
    """Vocabulary rows split over `batch` (padded), features over the row; every token looked up,
    zeros outside this rank's rows, then reduce-scattered to each rank's sequences."""

    def __init__(self, vocab: int, width: int, padded: int, batch: Axis, feature_index: int, q: int):
        super().__init__()
        rows = padded // batch.size
        self.batch, self.start, self.end = batch, batch.rank * rows, (batch.rank + 1) * rows
        self.weight = nn.Parameter(torch.empty(rows, width // q))
        self.tp_specs = {"weight": ShardSpec((vocab, width), padded=padded,
                                             cuts=((0, batch.size, batch.rank), (1, q, feature_index)))}

    def forward(self, tokens):
        outside = (tokens < self.start) | (tokens >= self.end)
        local = (tokens - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)
        return _scatter_batch(out, self.batch)


class GridTiedHead(nn.Module):
    """The head of a model whose head is its embedding matrix, cut as the embedding cuts it
    (vocabulary over the sequence group, features over the row): every sequence of the micro-batch
    gathered over the sequence group, multiplied by this rank's block (logits of its vocabulary
    rows, partial over its features), reduce-scattered over the row along the batch. The loss then
    runs over the sequence group's vocabulary split, for the row rank's share of the sequences."""

    def __init__(self, embedding: "GridEmbedding", row: Axis):
        super().__init__()
        self.embedding, self.row = [embedding], row  # in a list: its weight is the embedding's, not a second one

    def forward(self, x):
        everything = _gather_batch(x, self.embedding[0].batch)
        logits = F.linear(everything, self.embedding[0].weight)
        return _scatter_batch(logits, self.row)


class GridFeatures(nn.Module):
    """A position table (max_seq, d_model) cut by features as the residual stream is; each rank
    adds it to its own sequences, so its gradient is partial on every rank of the sequence group."""

    def __init__(self, table: nn.Embedding, batch: Axis, index: int, q: int):
        super().__init__()
        rows, width = table.weight.shape
        self.weight = nn.Parameter(torch.empty(rows, width // q))
        self.tp_specs = {"weight": ShardSpec((rows, width), cuts=((1, q, index),), owner=batch.rank == 0,
                                             **_partial(batch))}

    def forward(self, positions):
        return F.embedding(positions, self.weight)


class GridCrossEntropy(nn.Module):
    """Mean cross-entropy from logits split by vocabulary along `vocab_axis` and by sequence along
    `batch`: each rank takes its sequences' targets."""

    def __init__(self, vocab: int, padded: int, vocab_axis: Axis, batch: Axis):
        super().__init__()
        self.vocab, self.vocab_axis, self.batch = vocab, vocab_axis, batch
        self.start = vocab_axis.rank * padded // vocab_axis.size

    def forward(self, logits, targets):
        return _mean_over(self.token_losses(logits, targets).mean(), self.batch)

    def token_losses(self, logits, targets):
        """Each of this rank's tokens' loss (a chunk of the sequence at a time: strata/model/loss.py)."""
        targets = targets.chunk(self.batch.size, dim=0)[self.batch.rank]
        return vocab_parallel_losses(logits, targets, self.start, self.vocab, self.vocab_axis.group,
                                     self.vocab_axis.name)

    def mean(self, total, targets):
        """The mean over this rank's sequences' tokens, then over the sequence groups."""
        return _mean_over(total / targets.chunk(self.batch.size, dim=0)[self.batch.rank].numel(), self.batch)


class RefuseLogits(nn.Module):
    """In place of gathering the logits: a grid-parallel model's are blocks of sequences and
    vocabulary on every rank, and only its loss is computed in place. Generation and serving run
    under 1-D tensor parallelism (checkpoints are layout-free)."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode

    def forward(self, logits):
        raise ConfigError("computes only the loss; generate under tp_mode 1d (checkpoints load under any layout)",
                          "tp_mode", self.mode)


# --- applying it to the model ------------------------------------------------------------------
def apply_grid_parallel(model: nn.Module, groups: GridGroups) -> None:
    """Swap the layers of strata's Transformer (on the meta device) for their grid-parallel
    versions, as the family's description places each (the placements of 1-D tensor parallelism:
    which matrices read the features a norm produces, which return to the residual stream)."""
    cfg = model.cfg
    family = get_family(cfg.family)
    cut = _GridCutter(cfg, groups)
    with torch.device("meta"):
        for name, module in list(model.named_modules()):
            placement = family.placement(name)
            if placement is not None:
                model.set_submodule(name, cut(placement, module))
        row, batch = cut.axis("row"), cut.axis("batch")
        if cfg.tie_embeddings:  # the embedding's cut: vocabulary over the sequence group, sequences over the row
            model.set_tied_head(GridTiedHead(cut.embedding, row))
            model.criterion = GridCrossEntropy(cfg.vocab_size, cut.vocab, batch, row)
        else:
            model.criterion = GridCrossEntropy(cfg.vocab_size, cut.vocab, cut.axis("out_row"), cut.axis("out_batch"))
        model.gather_logits = RefuseLogits(groups.grid.mode)
    # q, k and v read the residual stream's features (along i): their outputs, the heads, lie along j
    heads = cfg.n_heads // groups.grid.q
    model.keep_heads(range(groups.at["j"] * heads, (groups.at["j"] + 1) * heads))


class _GridCutter:
    """placement, single-device module -> its grid-parallel replacement, each collective on the
    sub-group rules/tensor_traffic.grid_roles names for its role."""

    def __init__(self, cfg, groups: GridGroups):
        self.cfg, self.groups, self.grid = cfg, groups, groups.grid
        self.vocab = padded_vocab(cfg.vocab_size, self.grid)
        self.roles = grid_roles(self.grid)
        x_dim = 0 if self.grid.mode == "3d" else -1  # 3-D gathers its inputs along the batch, 2-D along features
        self.plans = {reads: LinearPlan(self.axis(f"x_{reads}"), x_dim, self.axis("w"), self.axis(f"y_{reads}"),
                                        self.axis("copies"), self.axis(f"bias_{reads}")) for reads in ("i", "j")}
        at = groups.at
        self.feature_index = at["i"] if self.grid.mode == "3d" else at["j"]  # of the residual stream

    def axis(self, role: str) -> Axis | None:
        name = self.roles[role]
        return self.groups[name] if name is not None else None

    def __call__(self, placement: str, module: nn.Module) -> nn.Module:
        return getattr(self, placement)(module)

    def _linear(self, module, reads: str, padded_out: int | None = None) -> GridLinear:
        q, at, plan = self.grid.q, self.groups.at, self.plans[reads]
        if self.grid.mode == "3d":
            # input features: split along the axis this layer reads them on, then along l
            in_index = (at["i"] if reads == "i" else at["j"]) * q + at["l"]
            out_index, owner = (at["j"] if reads == "i" else at["i"]), True
        else:
            in_index, out_index = at["i"], at["j"]
            owner = plan.copies is None or plan.copies.rank == 0
        return GridLinear(module.in_features, module.out_features, module.bias is not None, plan, out_index, q,
                          in_index, self.grid.weight_in_parts, owner, padded_out)

    def vocabulary(self, module):
        if isinstance(module, nn.Embedding):
            self.embedding = GridEmbedding(module.num_embeddings, module.embedding_dim, self.vocab,
                                           self.axis("batch"), self.feature_index, self.grid.q)  # a tied head reads it
            return self.embedding
        return self._linear(module, "i", self.vocab)

    def column(self, module):  # reads the residual stream's features
        return self._linear(module, "i")

    kv_column = column

    def row(self, module):  # returns to the residual stream
        return self._linear(module, "j")

    def input_norm(self, module):
        return GridNorm(module, self.cfg.norm, self.axis("row"), self.axis("batch"), self.feature_index, self.grid.q)

    def head_norm(self, module):
        return GridHeadNorm(module, self.cfg.norm, self.groups["tp"])

    def replicated(self, module):  # what the embedding hands the blocks: cut as the residual stream is
        if isinstance(module, nn.Embedding):
            return GridFeatures(module, self.axis("batch"), self.feature_index, self.grid.q)
        return self.input_norm(module)
