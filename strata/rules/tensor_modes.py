"""The ways of cutting tensor parallelism's matrices: Megatron's 1-D (Shoeybi et al. 2019) and
Colossal-AI's multi-dimensional ones, 2-D (Xu et al. 2021, SUMMA on a q x q grid), 2.5-D (Wang
et al. 2021, "Tesseract", q x q x d) and 3-D (Bian et al. 2021, q x q x q). One place for the
runtime (strata/parallel/tensor_nd.py) and the planner: which sizes a mode takes, what a model
needs to be cut so, how a rank's share of each tensor shrinks, and the bytes a rank sends.

The multi-dimensional modes cut the activations as well as the weights: between layers a rank
holds 1/|B| of the micro-batch's sequences (|B| = q for 2-D, q·d for 2.5-D, q² for 3-D) and 1/q of
the hidden features, so 1/tp of the activations, where 1-D holds all of them on every rank."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from strata.errors import ConfigError
from strata.model.config import ModelConfig

TP_MODES = ("1d", "2d", "2.5d", "3d")


@dataclass(frozen=True)
class TensorGrid:
    """The shape of a tensor-parallel group: mode, the grid's side q and its depth d."""
    mode: str
    q: int
    d: int = 1

    @property
    def size(self) -> int:
        return {"1d": self.q, "2d": self.q * self.q, "2.5d": self.q * self.q * self.d, "3d": self.q ** 3}[self.mode]

    @property
    def batch_parts(self) -> int:
        """How many ways a micro-batch's sequences are split between the layers (1 for 1-D)."""
        return {"1d": 1, "2d": self.q, "2.5d": self.q * self.d, "3d": self.q * self.q}[self.mode]

    @property
    def hidden_parts(self) -> int:
        """How many ways the hidden features between layers are split (1 for 1-D: replicated)."""
        return 1 if self.mode == "1d" else self.q

    @property
    def weight_parts(self) -> int:
        """How many ways a weight matrix is cut (2.5-D's d layers each hold the q x q blocks)."""
        return {"1d": self.q, "2d": self.q * self.q, "2.5d": self.q * self.q, "3d": self.q ** 3}[self.mode]

    @property
    def weight_in_parts(self) -> int:
        """How many ways a weight's input features are split on a rank (3-D cuts them q² ways)."""
        return {"1d": 1, "2d": self.q, "2.5d": self.q, "3d": self.q * self.q}[self.mode]


def grid_of(mode: str, tp: int, depth: int = 1, field: str = "tp") -> TensorGrid:
    """The grid of `tp` ranks in `mode`, or ConfigError naming what sizes would do."""
    if mode not in TP_MODES:
        raise ConfigError(f"valid: {', '.join(TP_MODES)}", "tp_mode", mode)
    if depth < 1:
        raise ConfigError("must be >= 1", "tp_depth", depth)
    if depth != 1 and mode != "2.5d":
        raise ConfigError(f"is the depth of 2.5-D tensor parallelism; tp_mode is {mode}", "tp_depth", depth)
    if mode == "1d":
        return TensorGrid("1d", tp)
    side = {"2d": 2, "2.5d": 2, "3d": 3}[mode]
    q = round((tp / depth) ** (1 / side))
    if q < 2 or q ** side * depth != tp:
        shape = {"2d": "q² (4, 9, 16, ...)", "2.5d": f"q² x tp_depth {depth} with q >= 2 "
                 f"({', '.join(str(n * n * depth) for n in (2, 3, 4))}, ...)", "3d": "q³ (8, 27, 64, ...)"}[mode]
        raise ConfigError(f"tp_mode {mode} needs {shape} ranks", field, tp)
    return TensorGrid(mode, q, depth)


def check_grid(model: ModelConfig, grid: TensorGrid, micro_batch: int) -> None:
    """Can this model be cut over the grid, and a micro-batch split between its sequence groups?"""
    if grid.mode == "1d":
        return
    q, name = grid.q, f"tp_mode {grid.mode}"
    if micro_batch % grid.batch_parts:
        raise ConfigError(f"must be a multiple of {grid.batch_parts} with {name} on {grid.size} ranks (each "
                          f"group of ranks holds 1/{grid.batch_parts} of a micro-batch's sequences)",
                          "micro_batch", micro_batch)
    for what, heads in (("attention heads", model.n_heads), ("KV heads", model.kv_heads)):
        if heads % q:
            raise ConfigError(f"{name}: the model's {heads} {what} must be a multiple of q = {q}", "tp", grid.size)
    parts = grid.weight_in_parts
    for what, width in (("d_model", model.d_model), ("d_ff", model.d_ff),
                        ("q width", model.q_dim), ("KV width", model.kv_heads * model.head_dim)):
        if width % parts:
            raise ConfigError(f"{name}: the model's {what} {width} must be a multiple of {parts}", "tp", grid.size)


def padded_vocab(vocab: int, grid: TensorGrid) -> int:
    """The vocabulary rounded up to a multiple of every way the embedding and head cut it."""
    return math.ceil(vocab / grid.size) * grid.size


# --- what a rank sends per micro-batch (ring volumes, as strata/distributed/comm.py counts) ---------
class GridTraffic:
    """Bytes a rank sends and collectives it enters, by sub-group (the names of GROUP_AXES, "tp" for
    the whole group), so that the planner can time each on the link it crosses."""

    def __init__(self):
        self.bytes: Counter = Counter()
        self.calls: Counter = Counter()

    def add(self, kind: str, nbytes: float, calls: int) -> None:
        self.bytes[kind] += nbytes
        self.calls[kind] += calls

    @property
    def total(self) -> float:
        return sum(self.bytes.values())


def _names(grid: TensorGrid) -> dict[str, str]:
    """The sub-group each role runs over. 3-D: `x_i`, `y_i` (a layer reading features split along
    i), `x_j`, `y_j` (along j); the residual stream's features lie along i (`row`), its sequences
    along (l, j) (`batch`); the head's output along j and (l, i) (`out_row`, `out_batch`)."""
    if grid.mode == "3d":
        return {"row": "i", "batch": "batch_j", "out_row": "j", "out_batch": "batch_i", "w": "l",
                "x_i": "j", "y_i": "i", "x_j": "i", "y_j": "j", "bias_i": "batch_i", "bias_j": "batch_j"}
    return {"row": "row", "batch": "batch", "out_row": "row", "out_batch": "batch", "w": "col", "copies": "depth",
            "x_i": "row", "x_j": "row", "bias_i": "batch", "bias_j": "batch"}


@dataclass(frozen=True)
class ElementBytes:
    """Bytes per element of what the grid's collectives move, as the runtime casts it: `block`, the
    input and weight blocks the linear layers gather and their gradients (autocast's dtype under
    bf16/fp16); `wide`, the norms' statistics and the loss's sums (fp32 or wider); `param`, the
    parameters' dtype: the gradients of vectors several ranks hold (norm weights, biases, 2.5-D's
    weight copies), the embedding's lookup and a tied head's input (the residual stream's dtype)."""
    block: int
    wide: int
    param: int

    @classmethod
    def uniform(cls, nbytes: int) -> "ElementBytes":
        return cls(nbytes, nbytes, nbytes)


def linear_bytes(out: GridTraffic, grid: TensorGrid, tokens: int, k: int, m: int, e: ElementBytes, bias: bool,
                 reads: str = "i") -> None:
    """One linear layer x (tokens, k) -> (tokens, m), forward and backward, on one rank. `reads`:
    3-D's orientation (features split along i: q, k, v, the MLP's first matrices, the head; along
    j: the output projections).

    2-D / 2.5-D (SUMMA, Xu et al. 2021; Tesseract's per depth layer): the input block is gathered
    along its features over the grid row and the weight block along its input features over the
    grid column ((q-1) blocks each, what SUMMA's q broadcasts deliver); the backward gathers both
    again (nothing gathered is kept) and reduce-scatters the input's and the weight's gradients
    over the same groups. 2.5-D sums the weight's gradient over the d layers.
    3-D (Bian et al. 2021, Algorithm 1): the input gathered along the batch over one axis, the
    weight along its input features over another, the output reduce-scattered along the batch over
    the third; backward: the output gradient gathered, input and weight gathered again, their
    gradients reduce-scattered."""
    q, d, names = grid.q, grid.d, _names(grid)
    x = tokens / grid.batch_parts * k / q  # elements of the local input block
    w = k / grid.weight_in_parts * m / q  # and of the local weight block
    out.add(names[f"x_{reads}"], 3 * (q - 1) * x * e.block, 3)
    out.add(names["w"], 3 * (q - 1) * w * e.block, 3)
    if grid.mode == "3d":
        out.add(names[f"y_{reads}"], 2 * (q - 1) * tokens / grid.batch_parts * m / q * e.block, 2)
    elif d > 1:
        out.add(names["copies"], 2 * (d - 1) / d * w * e.param, 1)
    if bias:  # summed over the ranks that add it to other sequences
        b = grid.batch_parts
        out.add(names[f"bias_{reads}"], 2 * (b - 1) / b * m / q * e.param, 1)


def norm_bytes(out: GridTraffic, grid: TensorGrid, tokens: int, width: int, e: ElementBytes, stats: int,
               weights: int) -> None:
    """A norm over features split q ways: its per-token statistics (`stats` of them: 1 for RMSNorm,
    2 for LayerNorm) all-reduced over the row forward and backward, its `weights` vectors'
    gradients summed over the ranks holding other sequences."""
    q, b, names = grid.q, grid.batch_parts, _names(grid)
    out.add(names["row"], 2 * 2 * (q - 1) / q * tokens / b * stats * e.wide, 2)
    out.add(names["batch"], weights * 2 * (b - 1) / b * width / q * e.param, weights)


def block_bytes(out: GridTraffic, model: ModelConfig, grid: TensorGrid, tokens: int, e: ElementBytes) -> None:
    """One transformer block (attention and MLP, their two norms, q/k norms), forward + backward."""
    h = model.d_model
    for k, m, bias, reads in block_linears(model):
        linear_bytes(out, grid, tokens, k, m, e, bias, reads)
    norm_stats, norm_weights = _norm_counts(model)
    norm_bytes(out, grid, tokens, h, e, norm_stats, norm_weights)
    norm_bytes(out, grid, tokens, h, e, norm_stats, norm_weights)
    if model.qk_norm:  # over each head's own features: no statistics cross ranks, weights summed over all
        n = grid.size
        out.add("tp", 2 * 2 * (n - 1) / n * model.head_dim * e.param, 2)


def block_linears(model: ModelConfig) -> list[tuple[int, int, bool, str]]:
    """(in, out, bias, orientation) of a block's matrices."""
    h, kv = model.d_model, model.kv_heads * model.head_dim
    mlp_in = 2 if model.gated_mlp else 1
    qkv_bias = model.bias or model.qkv_bias
    return [(h, model.q_dim, qkv_bias, "i"), (h, kv, qkv_bias, "i"), (h, kv, qkv_bias, "i"),
            (model.q_dim, h, model.bias, "j"), *[(h, model.d_ff, model.bias, "i")] * mlp_in,
            (model.d_ff, h, model.bias, "j")]


def _norm_counts(model: ModelConfig) -> tuple[int, int]:
    """(statistics per token, weight vectors) of the model's norm."""
    return (2, 2) if model.norm == "layernorm" else (1, 1)


def micro_batch_bytes(model: ModelConfig, grid: TensorGrid, tokens: int, e: ElementBytes,
                      recompute_blocks: int = 0, sequence_parallel: bool = False) -> GridTraffic:
    """Bytes a rank sends over each tensor-parallel sub-group for one micro-batch of `tokens`
    tokens (forward and backward; `recompute_blocks` blocks run their forward twice under
    checkpointing). 1-D (without recomputation): Megatron's count, under the name "tp"."""
    out = GridTraffic()
    if grid.mode == "1d":
        return _megatron_bytes(out, model, grid.q, tokens, e.block, sequence_parallel, e.wide)
    vocab = padded_vocab(model.vocab_size, grid)
    q, b, names = grid.q, grid.batch_parts, _names(grid)
    norm_stats, norm_weights = _norm_counts(model)
    # the vocabulary-split lookup reduce-scattered to each rank's sequences (all-gathered backward)
    out.add(names["batch"], 2 * (b - 1) / b * tokens * model.d_model / q * e.param, 2)
    if model.position == "learned":  # the table's gradient, summed over the sequence group
        out.add(names["batch"], 2 * (b - 1) / b * model.max_seq_len * model.d_model / q * e.param, 1)
    if model.embedding_norm:
        norm_bytes(out, grid, tokens, model.d_model, e, norm_stats, norm_weights)
    for _ in range(model.n_layers):
        block_bytes(out, model, grid, tokens, e)
    for _ in range(recompute_blocks):
        forward_block_bytes(out, model, grid, tokens, e)
    norm_bytes(out, grid, tokens, model.d_model, e, norm_stats, norm_weights)  # the final norm
    if model.tie_embeddings:
        # the embedding's matrix, cut as the embedding is: every sequence gathered over the sequence
        # group (reduce-scattered backward), the logits reduce-scattered over the row (gathered
        # backward), the loss over the sequence group's vocabulary split for 1/q of the tokens
        out.add(names["batch"], 2 * (b - 1) * tokens / b * model.d_model / q * e.param, 2)
        out.add(names["row"], 2 * (q - 1) / q * tokens * vocab / b * e.block, 2)
        _cross_entropy_bytes(out, names["batch"], b, names["row"], q, tokens / q, e.wide)
        return out
    linear_bytes(out, grid, tokens, model.d_model, vocab, e, model.bias)  # the head
    _cross_entropy_bytes(out, names["out_row"], q, names["out_batch"], b, tokens / b, e.wide)
    return out


def _megatron_bytes(out: GridTraffic, model: ModelConfig, t: int, tokens: int, elem: int, sequence_parallel: bool,
                    loss_elem: int) -> GridTraffic:
    """1-D (Shoeybi et al. 2019): per block 2 all-reduces of the tokens' hidden states forward and 2
    backward, 2(t-1)/t each; the embedding's all-reduce, the head input's copy (all-reduced
    backward), the loss's 3 numbers per token. With sequence parallelism (Korthikanti et al. 2022)
    the same volume in all-gathers and reduce-scatters, plus the re-gather of each column group's
    input in backward and the sequence split's gather (the norms' gradient sums are per step:
    `sequence_parallel_step_bytes`)."""
    ring, hidden = (t - 1) / t, tokens * model.d_model * elem
    per_block = 4 * 2 * ring * hidden + (2 * ring * hidden if sequence_parallel else 0)
    edges = 2 * 2 * ring * hidden + (2 * ring * hidden if sequence_parallel else 0)
    out.add("tp", model.n_layers * per_block + edges + 2 * ring * 3 * tokens * loss_elem, 0)
    return out


def sequence_parallel_step_bytes(model: ModelConfig, t: int, elem: int) -> float:
    """Once per step under 1-D sequence parallelism: the norms' gradients, each rank's from its
    1/t of the tokens, all-reduced."""
    return (2 * model.n_layers + 1) * model.d_model * elem * 2 * (t - 1) / t


def _cross_entropy_bytes(out: GridTraffic, vocab_group: str, vocab_parts: int, mean_group: str, mean_parts: int,
                         tokens: float, loss_elem: int) -> None:
    """Megatron's vocabulary-parallel cross-entropy over `vocab_group` for this rank's `tokens`: the
    maximum, then the target logit and the sum of exponentials (fp32 or wider); then the mean
    over the ranks holding other tokens (forward only)."""
    out.add(vocab_group, 2 * (vocab_parts - 1) / vocab_parts * 3 * tokens * loss_elem, 2)
    out.add(mean_group, 2 * (mean_parts - 1) / mean_parts * loss_elem, 1)


def forward_block_bytes(out: GridTraffic, model: ModelConfig, grid: TensorGrid, tokens: int, e: ElementBytes) -> None:
    """A block's forward again (recomputation): the gathers (and 3-D's reduce-scatters) and the
    norms' forward statistics."""
    q, b, names = grid.q, grid.batch_parts, _names(grid)
    for k, m, _, reads in block_linears(model):
        out.add(names[f"x_{reads}"], (q - 1) * tokens / b * k / q * e.block, 1)
        out.add(names["w"], (q - 1) * k / grid.weight_in_parts * m / q * e.block, 1)
        if grid.mode == "3d":
            out.add(names[f"y_{reads}"], (q - 1) * tokens / b * m / q * e.block, 1)
    out.add(names["row"], 2 * 2 * (q - 1) / q * tokens / b * _norm_counts(model)[0] * e.wide, 2)


def group_shape(grid: TensorGrid, kind: str) -> tuple[int, int]:
    """(size, stride) of a sub-group for the planner's link model: its ranks span size x stride
    consecutive ranks of the tensor-parallel group."""
    if kind == "tp":
        return grid.size, 1
    varying = GROUP_AXES[grid.mode][kind]
    size = math.prod(grid.d if axis == "k" else grid.q for axis in varying)
    span = max(t for t in group_members(grid, varying)[0]) + 1
    return size, max(1, span // size)


# --- where a rank sits on the grid ------------------------------------------------------------------
# A rank's place t in its tensor-parallel group (t = 0 .. size-1, consecutive global ranks) -> its
# coordinates. 2-D/2.5-D: t = k·q² + i·q + j (grid row i, column j, depth layer k); 3-D:
# t = l·q² + j·q + i. The orders are chosen so that every group below, listed by increasing global
# rank, numbers its members in the order the tensors are cut: a group's rank is the index of the
# piece its member holds.
def coordinates(grid: TensorGrid, t: int) -> dict[str, int]:
    q = grid.q
    if grid.mode in ("2d", "2.5d"):
        return {"k": t // (q * q), "i": t // q % q, "j": t % q}
    return {"l": t // (q * q), "j": t // q % q, "i": t % q}


# The groups of each mode, by the coordinates that vary along them (the others are fixed).
#   2-D / 2.5-D: row (features of activations split along it), col (a weight's input features),
#   depth (2.5-D's layers, each a copy of the weights), batch (the sequences: column and depth).
#   3-D: x, w, y (Bian et al.'s input, weight and output axes of a layer reading features split
#   along i; a layer reading features split along j swaps i and j), and the two batch groups.
GROUP_AXES = {
    "2d": {"row": ("j",), "col": ("i",), "batch": ("i",)},
    "2.5d": {"row": ("j",), "col": ("i",), "depth": ("k",), "batch": ("k", "i")},
    "3d": {"i": ("i",), "j": ("j",), "l": ("l",), "batch_j": ("l", "j"), "batch_i": ("l", "i")},
}


def group_members(grid: TensorGrid, varying: tuple[str, ...]) -> list[list[int]]:
    """The places t of every group along `varying` (one list per group, increasing)."""
    groups: dict[tuple, list[int]] = {}
    for t in range(grid.size):
        c = coordinates(grid, t)
        groups.setdefault(tuple(v for k, v in sorted(c.items()) if k not in varying), []).append(t)
    return list(groups.values())
