"""What tensor parallelism sends, per rank: the one count that the runtime's collectives are tested
against (tests/test_tensor_nd.py, tests/test_tensor_parallel.py, to the byte) and that the
planner times (strata/plan/grid.py, strata/plan/cost.py). Volumes are the ring algorithms', as
strata/distributed/comm.py counts them: all-gather (n-1)/n of its output, reduce-scatter (n-1)/n of
its input, all-reduce 2(n-1)/n.

1-D (Megatron, Shoeybi et al. 2019; sequence parallelism, Korthikanti et al. 2022) in ring volumes
of one micro-batch's hidden states; the grids (tensor_modes.py) per linear layer, norm, embedding
and head, by (sub-group, operation). The grids' vectors that several ranks hold (norm weights,
biases, 2.5-D's weight copies) have their gradients summed once per step, after the last
micro-batch (`step_sums`), as 1-D's sequence-parallel norms do."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from strata.model.config import ModelConfig
from strata.rules.tensor_modes import TensorGrid, padded_vocab


@dataclass(frozen=True)
class ElementBytes:
    """Bytes per element of what the collectives move, as the runtime casts it: `block`, the
    input and weight blocks the linear layers gather and the activations' gradients (autocast's
    dtype under bf16/fp16); `wide`, the norms' statistics and the loss's sums (fp32 or wider);
    `param`, the parameters' dtype: weight gradients (summed in it, as data parallelism's are), the
    embedding's lookup and a tied head's input (the residual stream's dtype)."""
    block: int
    wide: int
    param: int

    @classmethod
    def uniform(cls, nbytes: int) -> "ElementBytes":
        return cls(nbytes, nbytes, nbytes)


class GridTraffic:
    """Bytes a rank sends and collectives it enters, by (sub-group, operation): the sub-groups are
    tensor_modes.GROUP_AXES's names ("tp" for the whole group), the operations comm.py's."""

    def __init__(self):
        self.bytes: Counter = Counter()
        self.calls: Counter = Counter()

    def add(self, group: str, op: str, nbytes: float, calls: int = 1) -> None:
        self.bytes[(group, op)] += nbytes
        self.calls[(group, op)] += calls

    def add_all(self, other: "GridTraffic", times: float = 1) -> None:
        for key, nbytes in other.bytes.items():
            self.bytes[key] += times * nbytes
            self.calls[key] += times * other.calls[key]

    def by_group(self) -> dict[str, float]:
        out: Counter = Counter()
        for (group, _), nbytes in self.bytes.items():
            out[group] += nbytes
        return dict(out)

    @property
    def total(self) -> float:
        return sum(self.bytes.values())


# --- 1-D -------------------------------------------------------------------------------------------
def megatron_block_collectives(sequence_parallel: bool, full_recompute: bool) -> int:
    """Collectives of one block's micro-batch on the hidden states, forward and backward: without
    sequence parallelism 4 all-reduces (2 ring volumes each); with it 4 all-gathers, 4 reduce-
    scatters and the re-gather of each column group's kept shard in backward (1 volume each).
    Full recomputation runs the forward again up to the last tensor backward needs (torch's
    checkpoint stops there), which leaves out the block's last reduction: 1 more collective."""
    return (10 if sequence_parallel else 4) + (1 if full_recompute else 0)


def megatron_edge_volumes(sequence_parallel: bool) -> tuple[int, int]:
    """Ring volumes of a micro-batch's hidden states at the embedding (its all-reduce; under
    sequence parallelism the split's gather in backward too) and at the head (its input's copy,
    all-reduced in backward; under sequence parallelism gathered, reduce-scattered back and
    re-gathered in backward)."""
    return (3, 3) if sequence_parallel else (2, 2)


def megatron_micro_batch_bytes(model: ModelConfig, t: int, tokens: int, e: ElementBytes, recompute_blocks: int,
                               sequence_parallel: bool) -> float:
    """1-D, one micro-batch: every block's collectives, the embedding's and the head's, and the
    vocabulary-parallel loss's 3 numbers per token (maximum, target logit, sum of exponentials)."""
    volume = (t - 1) / t * tokens * model.d_model * e.block
    per_call = volume * (1 if sequence_parallel else 2)
    blocks = model.n_layers * megatron_block_collectives(sequence_parallel, False) * per_call
    recomputed = recompute_blocks * (megatron_block_collectives(sequence_parallel, True)
                                     - megatron_block_collectives(sequence_parallel, False)) * per_call
    return blocks + recomputed + sum(megatron_edge_volumes(sequence_parallel)) * volume + \
        2 * (t - 1) / t * 3 * tokens * e.wide


def sequence_parallel_step_bytes(model: ModelConfig, t: int, elem: int) -> float:
    """Once per step under 1-D sequence parallelism: the norms' gradients, each rank's from its
    1/t of the tokens, all-reduced."""
    return (2 * model.n_layers + 1) * model.d_model * elem * 2 * (t - 1) / t


# --- the grids: which sub-group each role runs over -------------------------------------------------
def grid_roles(grid: TensorGrid) -> dict[str, str | None]:
    """The sub-group each role runs over (None: a role this mode does not have), for the runtime's
    layers (parallel/tensor_nd.py) and this count alike. A linear layer reads features split
    along i (q, k, v, the MLP's first matrices, the head: `_i`) or, in 3-D, along j (the output
    projections: `_j`): `x` gathers its input, `w` its weight, `y` (3-D) reduce-scatters its
    output, `copies` sums 2.5-D's weight copies, `bias` its bias. The residual stream's features
    lie along `row`, its sequences along `batch`; the head's logits along `out_row`, `out_batch`."""
    if grid.mode == "3d":
        return {"row": "i", "batch": "batch_j", "out_row": "j", "out_batch": "batch_i", "w": "l", "copies": None,
                "x_i": "j", "y_i": "i", "bias_i": "batch_i", "x_j": "i", "y_j": "j", "bias_j": "batch_j"}
    return {"row": "row", "batch": "batch", "out_row": "row", "out_batch": "batch", "w": "col",
            "copies": "depth" if grid.d > 1 else None,
            "x_i": "row", "y_i": None, "bias_i": "batch", "x_j": "row", "y_j": None, "bias_j": "batch"}


def _ring(n: int) -> float:
    return (n - 1) / n


# --- the grids, per micro-batch ---------------------------------------------------------------------
def linear_bytes(out: GridTraffic, grid: TensorGrid, tokens: float, k: int, m: int, e: ElementBytes,
                 reads: str = "i", forward_only: bool = False) -> None:
    """One linear layer x (tokens, k) -> (tokens, m) on one rank, forward and backward.

    2-D / 2.5-D (SUMMA, Xu et al. 2021; Tesseract's per depth layer, Wang et al. 2021): the input
    block gathered along its features over the row and the weight block along its input features
    over the column ((q-1) blocks each: what SUMMA's q broadcasts deliver); backward gathers both
    again (nothing gathered is kept) and reduce-scatters the input's and the weight's gradients.
    3-D (Bian et al. 2021, Algorithm 1): the input gathered along the batch over one axis, the
    weight along its input features over another, the output reduce-scattered along the batch over
    the third; backward gathers the output's gradient, the input and the weight again and reduce-
    scatters their gradients."""
    q, roles = grid.q, grid_roles(grid)
    x = tokens / grid.batch_parts * k / q  # elements of the local input block
    w = k / grid.weight_in_parts * m / q  # of the local weight block
    y = tokens / grid.batch_parts * m / q  # of the local output block (3-D)
    passes = 1 if forward_only else 2
    out.add(roles[f"x_{reads}"], "all_gather", passes * (q - 1) * x * e.block, passes)
    out.add(roles["w"], "all_gather", passes * (q - 1) * w * e.block, passes)
    if roles[f"y_{reads}"] is not None:
        out.add(roles[f"y_{reads}"], "reduce_scatter", (q - 1) * y * e.block)
        if not forward_only:
            out.add(roles[f"y_{reads}"], "all_gather", (q - 1) * y * e.block)
    if not forward_only:
        out.add(roles[f"x_{reads}"], "reduce_scatter", (q - 1) * x * e.block)
        out.add(roles["w"], "reduce_scatter", (q - 1) * w * e.param)


def norm_bytes(out: GridTraffic, grid: TensorGrid, tokens: float, model: ModelConfig, e: ElementBytes,
               forward_only: bool = False) -> None:
    """A norm over features split q ways: its per-token statistics all-reduced over the row, one
    all-reduce each forward and backward (RMSNorm: the sum of squares; LayerNorm: the sum, then the
    sum of squares about the mean, two passes for accuracy)."""
    statistics = 2 if model.norm == "layernorm" else 1
    passes = statistics * (1 if forward_only else 2)
    out.add(grid_roles(grid)["row"], "all_reduce", passes * 2 * _ring(grid.q) * tokens / grid.batch_parts * e.wide,
            passes)


def block_linears(model: ModelConfig) -> list[tuple[int, int, bool, str]]:
    """(in, out, bias, orientation) of a block's matrices: q, k, v, the attention's output, the
    MLP's input matrices (two when gated) and its output."""
    h, kv = model.d_model, model.kv_heads * model.head_dim
    qkv_bias = model.bias or model.qkv_bias
    return [(h, model.q_dim, qkv_bias, "i"), (h, kv, qkv_bias, "i"), (h, kv, qkv_bias, "i"),
            (model.q_dim, h, model.bias, "j"), *[(h, model.d_ff, model.bias, "i")] * (2 if model.gated_mlp else 1),
            (model.d_ff, h, model.bias, "j")]


def block_bytes(model: ModelConfig, grid: TensorGrid, tokens: float, e: ElementBytes,
                forward_only: bool = False) -> GridTraffic:
    """One block's micro-batch: its linear layers and its two norms (forward_only: the forward run
    again under full recomputation)."""
    out = GridTraffic()
    for k, m, _, reads in block_linears(model):
        linear_bytes(out, grid, tokens, k, m, e, reads, forward_only)
    for _ in range(2):
        norm_bytes(out, grid, tokens, model, e, forward_only)
    return out


def embedding_bytes(model: ModelConfig, grid: TensorGrid, tokens: float, e: ElementBytes) -> GridTraffic:
    """The first stage's micro-batch: every rank looks every token up in its vocabulary rows and a
    reduce-scatter over the sequence group hands each rank its sequences' sums (all-gathered in
    backward); the embedding's norm, if any."""
    out, roles, b = GridTraffic(), grid_roles(grid), grid.batch_parts
    lookup = _ring(b) * tokens * model.d_model / grid.q * e.param
    out.add(roles["batch"], "reduce_scatter", lookup)
    out.add(roles["batch"], "all_gather", lookup)
    if model.embedding_norm:
        norm_bytes(out, grid, tokens, model, e)
    return out


def output_bytes(model: ModelConfig, grid: TensorGrid, tokens: float, e: ElementBytes) -> GridTraffic:
    """The last stage's micro-batch: the final norm, the head, and Megatron's vocabulary-parallel
    cross-entropy (the maximum, then the target logit and the sum of exponentials, over the ranks
    splitting the vocabulary; then the mean over the ranks holding other tokens, forward only)."""
    out, roles, q, b = GridTraffic(), grid_roles(grid), grid.q, grid.batch_parts
    norm_bytes(out, grid, tokens, model, e)
    vocab = padded_vocab(model.vocab_size, grid)
    if model.tie_embeddings:
        # cut as the embedding is: every sequence gathered over the sequence group (reduce-scattered
        # backward), the partial logits reduce-scattered over the row (gathered backward); the loss
        # over the sequence group's vocabulary split for the row rank's 1/q of the tokens
        gathered = _ring(b) * tokens * model.d_model / q * e.param
        out.add(roles["batch"], "all_gather", gathered)
        out.add(roles["batch"], "reduce_scatter", gathered)
        logits = _ring(q) * tokens * vocab / b * e.block
        out.add(roles["row"], "reduce_scatter", logits)
        out.add(roles["row"], "all_gather", logits)
        vocab_group, vocab_parts, mean_group, mean_parts, own_tokens = roles["batch"], b, roles["row"], q, tokens / q
    else:
        linear_bytes(out, grid, tokens, model.d_model, vocab, e)
        vocab_group, vocab_parts = roles["out_row"], q
        mean_group, mean_parts, own_tokens = roles["out_batch"], b, tokens / b
    out.add(vocab_group, "all_reduce", 2 * _ring(vocab_parts) * 3 * own_tokens * e.wide, 2)  # max; (target, sum)
    out.add(mean_group, "all_reduce", 2 * _ring(mean_parts) * e.wide)
    return out


# --- the grids, once per step ----------------------------------------------------------------------
def block_step_sums(model: ModelConfig, grid: TensorGrid, e: ElementBytes) -> GridTraffic:
    """One block's vectors whose gradients are partial on each rank, summed once a step: biases
    over the ranks adding them to other sequences, 2.5-D's weight blocks over the depth, the two
    norms' weights over the sequence group, Qwen3's per-head q/k norms over the whole group."""
    out = GridTraffic()
    for k, m, bias, reads in block_linears(model):
        _linear_step_sums(out, grid, k, m, bias, reads, e)
    _norm_step_sums(out, grid, model, e)
    _norm_step_sums(out, grid, model, e)
    if model.qk_norm:
        out.add("tp", "all_reduce", 2 * 2 * _ring(grid.size) * model.head_dim * e.param, 0)
    return out


def embedding_step_sums(model: ModelConfig, grid: TensorGrid, e: ElementBytes) -> GridTraffic:
    """The first stage's: a learned position table (cut by features, added to every rank's own
    sequences) and the embedding's norm."""
    out = GridTraffic()
    if model.position == "learned":
        out.add(grid_roles(grid)["batch"], "all_reduce",
                2 * _ring(grid.batch_parts) * model.max_seq_len * model.d_model / grid.q * e.param, 0)
    if model.embedding_norm:
        _norm_step_sums(out, grid, model, e)
    return out


def output_step_sums(model: ModelConfig, grid: TensorGrid, e: ElementBytes) -> GridTraffic:
    """The last stage's: the final norm, and an untied head's bias and 2.5-D copies."""
    out = GridTraffic()
    _norm_step_sums(out, grid, model, e)
    if not model.tie_embeddings:
        _linear_step_sums(out, grid, model.d_model, padded_vocab(model.vocab_size, grid), model.bias, "i", e)
    return out


def _linear_step_sums(out: GridTraffic, grid: TensorGrid, k: int, m: int, bias: bool, reads: str,
                      e: ElementBytes) -> None:
    roles = grid_roles(grid)
    if roles["copies"] is not None:
        d = grid.d
        out.add(roles["copies"], "all_reduce", 2 * _ring(d) * k / grid.weight_in_parts * m / grid.q * e.param, 0)
    if bias:
        out.add(roles[f"bias_{reads}"], "all_reduce", 2 * _ring(grid.batch_parts) * m / grid.q * e.param, 0)


def _norm_step_sums(out: GridTraffic, grid: TensorGrid, model: ModelConfig, e: ElementBytes) -> None:
    vectors = 2 if model.norm == "layernorm" else 1  # weight (and bias)
    out.add(grid_roles(grid)["batch"], "all_reduce",
            vectors * 2 * _ring(grid.batch_parts) * model.d_model / grid.q * e.param, 0)


def one_call_per_group(sums: GridTraffic) -> GridTraffic:
    """A step's sums as the runtime issues them: one all-reduce of the concatenated gradients per
    sub-group."""
    for key in sums.bytes:
        sums.calls[key] = 1
    return sums


# --- a whole step ------------------------------------------------------------------------------------
@dataclass
class GridParts:
    """A micro-batch's traffic by part, and a step's sums, for a stage's share of the model."""
    first: GridTraffic  # the embedding (first stage)
    block: GridTraffic  # one block
    again: GridTraffic  # one block's forward again (full recomputation)
    last: GridTraffic  # the final norm, head and loss (last stage)
    first_step: GridTraffic  # once a step: the first stage's sums
    block_step: GridTraffic  # one block's
    last_step: GridTraffic  # the last stage's


def grid_parts(model: ModelConfig, grid: TensorGrid, tokens: float, e: ElementBytes) -> GridParts:
    return GridParts(embedding_bytes(model, grid, tokens, e), block_bytes(model, grid, tokens, e),
                     block_bytes(model, grid, tokens, e, forward_only=True), output_bytes(model, grid, tokens, e),
                     embedding_step_sums(model, grid, e), block_step_sums(model, grid, e),
                     output_step_sums(model, grid, e))


def step_traffic(model: ModelConfig, grid: TensorGrid, tokens: float, e: ElementBytes, micro_batches: int = 1,
                 recompute_blocks: int = 0, sequence_parallel: bool = False) -> tuple[GridTraffic, GridTraffic]:
    """What a rank of a one-stage model sends over the tensor-parallel groups in a step of
    `micro_batches` micro-batches of `tokens` tokens (`recompute_blocks` blocks recomputed in
    each): (the micro-batches' collectives, the step's sums of partial gradients). Under ZeRO-1/2
    a rank sums only its data-parallel shard of those gradients: the data-parallel group's ranks
    together send the sums once. 1-D under the name "tp" (its sums: sequence parallelism's norms)."""
    per_micro_batch, sums = GridTraffic(), GridTraffic()
    if grid.mode == "1d":
        t = grid.size
        per_micro_batch.add("tp", "all", micro_batches * megatron_micro_batch_bytes(
            model, t, tokens, e, recompute_blocks, sequence_parallel), 0)
        if sequence_parallel:
            sums.add("tp", "all_reduce", sequence_parallel_step_bytes(model, t, e.param))
        return per_micro_batch, sums
    parts = grid_parts(model, grid, tokens, e)
    for part, times in ((parts.first, 1), (parts.block, model.n_layers), (parts.again, recompute_blocks),
                        (parts.last, 1)):
        per_micro_batch.add_all(part, micro_batches * times)
    for part, times in ((parts.first_step, 1), (parts.block_step, model.n_layers), (parts.last_step, 1)):
        sums.add_all(part, times)
    return per_micro_batch, one_call_per_group(sums)


def step_bytes(model: ModelConfig, grid: TensorGrid, tokens: float, e: ElementBytes, micro_batches: int = 1,
               recompute_blocks: int = 0, sequence_parallel: bool = False) -> GridTraffic:
    """step_traffic's two parts together (a rank without ZeRO-1/2's sharded gradients)."""
    out, sums = step_traffic(model, grid, tokens, e, micro_batches, recompute_blocks, sequence_parallel)
    out.add_all(sums)
    return out
