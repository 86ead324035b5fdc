"""The compute time of one micro-batch on one rank, built from the shapes of its work rather than
from one efficiency constant (docs/cost-model.md, "Compute"):

- every GEMM from its shape (m = the micro-batch's tokens; n and k after the tensor-parallel split)
  on the device's curve: a fixed cost per GEMM plus its FLOPs at the largest GEMMs' rate, so small
  GEMMs run below the peak and large ones approach it (the curve saturates); a GEMM that moves
  more bytes than it computes (attention's batched GEMMs, unfused) runs at the memory's rate;
- attention from its own shape: fused (one kernel at the device's attention rate), or unfused
  (two batched GEMMs and the softmax's and dropout's passes over the b·a·s² scores);
- what is not a GEMM (norms, residual adds, the MLP's activation, rotary, the loss's fp32 logits)
  as bytes through memory at the device's elementwise rate, plus a cost per kernel launched.

FP8 (`fp8_peak`): the blocks' linear layers' GEMMs, forward and both backward, at the device's FP8
peak and FP8 curve, their operands one byte each, as Transformer Engine's recipe runs them; the
head's GEMM, attention and everything else as in a 16-bit run. A power cap slows what the compute
clock sets (the GEMMs' FLOPs, fused attention: Kernels.clock_factor), not the memory's rate.

The device side is `Kernels`: from the device table (with sources) or measured here by
`strata calibrate`."""

from __future__ import annotations

from dataclasses import dataclass

from strata.model.config import ModelConfig
from strata.plan.experts import moe_elementwise, moe_gemms
from strata.plan.hardware import Device, Kernels
from strata.rules.tensor_modes import TensorGrid
from strata.rules.tensor_traffic import block_linears


@dataclass(frozen=True)
class StepWork:
    """What one rank computes for one micro-batch, independent of where it runs."""
    model: ModelConfig
    tokens: int  # per micro-batch: micro-batch x sequence
    micro_batch: int
    seq_len: int
    tp: int
    sequence_parallel: bool
    fused_attention: bool
    element_bytes: int  # of an activation: 2 for bf16/fp16 runs, 4 for fp32
    # 2-D, 2.5-D or 3-D tensor parallelism (tp is then the grid's size, and every activation split
    # tp ways, as sequence_parallel says); None: Megatron's 1-D
    grid: TensorGrid | None = None
    ep: int = 1  # a mixture's expert-parallel degree: each rank runs n_experts / ep experts on ep ranks' rows


def grid_gemm(grid: TensorGrid, tokens: float, k: float, m: float) -> tuple[float, float, float]:
    """(m, n, k) of one rank's GEMM for a linear layer (tokens, k) -> (tokens, m) on the grid: 2-D
    and 2.5-D multiply their sequences' gathered input rows by a weight column block
    (tokens/|B|, m/q, k); 3-D the input gathered over q groups of sequences by its block of
    input features (tokens/q, m/q, k/q)."""
    q = grid.q
    if grid.mode == "3d":
        return (tokens / q, m / q, k / q)
    return (tokens / grid.batch_parts, m / q, k)


@dataclass(frozen=True)
class UnitSeconds:
    """Seconds of one unit, forward and backward (the recomputation is the forward again)."""
    forward: float
    backward: float
    attention_forward: float  # what selective recomputation runs again

    @property
    def attention_backward(self) -> float:
        """The attention's backward, inside `backward`: twice the forward's FLOPs at its rate."""
        return ATTENTION_BACKWARD * self.attention_forward


ATTENTION_BACKWARD = 2  # the attention's backward over its forward (scores again, dQ, dK, dV)


def block_gemms(w: StepWork) -> list[tuple[float, float, float]]:
    """The (m, n, k) of each GEMM of a block's forward on one tensor-parallel rank (q, k, v and
    the output projection; the MLP's two or three)."""
    cfg, t, m = w.model, w.tp, w.tokens
    if w.grid is not None:
        return [grid_gemm(w.grid, m, k, n) for k, n, _, _ in block_linears(cfg)]
    kv = cfg.kv_heads * cfg.head_dim
    attention = [(m, cfg.q_dim / t, cfg.d_model), (m, kv / t, cfg.d_model), (m, kv / t, cfg.d_model),
                 (m, cfg.d_model, cfg.q_dim / t)]
    if cfg.moe:
        return attention + moe_gemms(cfg, m, t, w.ep)
    ins = [(m, cfg.d_ff / t, cfg.d_model)] * (2 if cfg.gated_mlp else 1)
    return attention + ins + [(m, cfg.d_model, cfg.d_ff / t)]


def head_gemm(w: StepWork) -> tuple[float, float, float]:
    if w.grid is not None:
        if w.model.tie_embeddings:  # every sequence by the embedding's block (vocabulary/|B|, features/q)
            return (w.tokens, w.model.vocab_size / w.grid.batch_parts, w.model.d_model / w.grid.q)
        return grid_gemm(w.grid, w.tokens, w.model.d_model, w.model.vocab_size)
    return (w.tokens, w.model.vocab_size / w.tp, w.model.d_model)


def attention_flops(w: StepWork) -> float:
    """Forward FLOPs of the scores and the weighted values of one layer on one rank, as the model
    counts them (ModelConfig.attention_products: 4·s·h per token, s at most the sliding window; a
    family's own block's average over its layers)."""
    return 2 * w.tokens * w.model.attention_products(w.seq_len) / w.model.n_layers / w.tp


# Elements read and written per element of each op's output, as PyTorch's eager kernels run the
# ops of strata's blocks (strata/model/layers.py): RMSNorm as x², its mean, x·rstd and ·weight
# (LayerNorm is one fused kernel); a residual add; a gated MLP's activation and product (a plain
# one's activation); rotary as the rotated half (neg, cat), x·cos, rotated·sin and their sum; the
# attention output's transpose back to (batch, seq, heads·head_dim), a copy.
NORM_PASSES = {"rmsnorm": 7, "gemma_rmsnorm": 9, "layernorm": 2}
ADD_PASSES = 3
GATED_MLP_PASSES, MLP_PASSES = 5, 2
ROTARY_PASSES = 10
TRANSPOSE_PASSES = 2


def block_elementwise(w: StepWork) -> tuple[float, int]:
    """(elements read and written, kernels) of a block's forward outside its GEMMs and fused
    attention, per rank (the passes above). Without sequence parallelism every tensor-parallel
    rank repeats the norms and adds on the whole hidden state; the MLP's activation, rotary and
    the attention's transpose are split with the heads and the MLP's width."""
    cfg, t = w.model, w.tp
    hidden = cfg.d_model / (t if w.sequence_parallel else 1)
    norms = 2 * NORM_PASSES[cfg.norm] * hidden
    adds = 2 * ADD_PASSES * hidden
    activation = (GATED_MLP_PASSES if cfg.gated_mlp else MLP_PASSES) * cfg.d_ff / t
    rope = cfg.position == "rope"
    rotary = ROTARY_PASSES * (cfg.q_dim + cfg.kv_heads * cfg.head_dim) / t if rope else 0
    transpose = TRANSPOSE_PASSES * cfg.q_dim / t
    kernels = 2 * (4 if cfg.norm != "layernorm" else 1) + 2 + (2 if cfg.gated_mlp else 1) + (10 if rope else 0) + 1
    if cfg.moe:  # the experts' activations on k rows per token, and the routing's passes
        activation, routing, moe_kernels = moe_elementwise(cfg, t, w.ep, GATED_MLP_PASSES)
        activation += routing
        kernels += moe_kernels
    return (norms + adds + activation + rotary + transpose) * w.tokens, kernels


FP8_BYTES = 1


def fp8_flops(device: Device) -> float:
    """The FP8 peak the blocks' GEMMs run at under --fp8 (plan/inputs.py refuses the flag where the
    device has none: here that is a bug)."""
    if device.fp8_flops is None or device.kernels.fp8_gemm_fraction is None:
        raise ValueError(f"fp8 on {device.name}, which has no FP8 peak or FP8 GEMM curve")
    return device.fp8_flops


def block_gemm_seconds(w: StepWork, k: Kernels, peak: float, bandwidth: float, fp8_peak: float | None = None) -> float:
    """A block's forward GEMMs (block_gemms) on one rank: in the run's 16-bit dtype at `peak`, or
    in FP8 at `fp8_peak` on the FP8 curve."""
    kernels, rate, eb = (k, peak, w.element_bytes) if fp8_peak is None else (k.fp8(), fp8_peak, FP8_BYTES)
    return sum(kernels.gemm_seconds(m, n, kk, rate, bandwidth, eb) for m, n, kk in block_gemms(w))


def unit_seconds(w: StepWork, k: Kernels, peak: float, bandwidth: float,
                 fp8_peak: float | None = None) -> tuple[UnitSeconds, UnitSeconds, UnitSeconds]:
    """(the embedding, one block, the head with its loss) for one micro-batch on one rank; with
    fp8_peak the blocks' linear layers in FP8 (the module's docstring)."""
    cfg, eb = w.model, w.element_bytes
    elementwise_rate = bandwidth * k.bandwidth_fraction

    def gemms(shapes):
        return sum(k.gemm_seconds(m, n, kk, peak, bandwidth, eb) for m, n, kk in shapes)

    def elementwise(elements: float, kernels: int) -> float:
        return elements * eb / elementwise_rate + kernels * k.kernel_overhead_s

    if w.fused_attention:
        attention_fwd = attention_flops(w) / (peak * k.attention_fraction * k.clock_factor)
        attention_bwd = ATTENTION_BACKWARD * attention_fwd
    else:  # scores and values as batched GEMMs (heads x micro-batch of them), softmax and dropout between
        s, heads = w.seq_len, w.micro_batch * cfg.n_heads / w.tp
        window = cfg.attended_positions(s)
        bmm = k.gemm_seconds(s, window, cfg.head_dim, peak, bandwidth, eb, heads) + \
            k.gemm_seconds(s, cfg.head_dim, window, peak, bandwidth, eb, heads)
        # scale-mask-softmax reads and writes the scores; dropout reads them, writes them and a mask
        scores = heads * s * window
        attention_fwd = bmm + (4 * eb + 1) * scores / elementwise_rate + 2 * k.kernel_overhead_s
        attention_bwd = ATTENTION_BACKWARD * attention_fwd
    elements, kernels = block_elementwise(w)
    block_gemm = block_gemm_seconds(w, k, peak, bandwidth, fp8_peak)
    block = UnitSeconds(block_gemm + attention_fwd + elementwise(elements, kernels),
                        2 * block_gemm + attention_bwd + 2 * elementwise(elements, kernels), attention_fwd)
    hidden = cfg.d_model / (w.tp if w.sequence_parallel else 1)
    embed_fwd = elementwise(2 * hidden * w.tokens, 1)
    embedding = UnitSeconds(embed_fwd, 2 * embed_fwd, 0.0)
    # the loss: the logits copied to fp32, read for the log-softmax, the gradient written back; an
    # exponential of every logit in the forward (log-softmax) and again in the backward (softmax)
    loss = (w.tokens * cfg.vocab_size / w.tp) * ((eb + 4 + 4) / elementwise_rate + k.exp_s) + 3 * k.kernel_overhead_s
    head_gemm_s = gemms([head_gemm(w)])
    head = UnitSeconds(head_gemm_s + loss + elementwise(2 * hidden * w.tokens, 1),
                       2 * head_gemm_s + loss + 2 * elementwise(2 * hidden * w.tokens, 1), 0.0)
    return embedding, block, head


def best_gemm_efficiency(w: StepWork, k: Kernels, peak: float, bandwidth: float, fp8_peak: float | None = None) -> float:
    """The highest fraction of the (16-bit) peak any of this work's kernels reaches: the GEMMs on
    the curve (the blocks' in FP8 with fp8_peak, which can pass 1), and fused attention. No step
    can show a higher MFU."""
    blocks = block_gemms(w)
    if fp8_peak is None:
        best = max(k.gemm_efficiency(m, n, kk, peak, bandwidth, w.element_bytes) for m, n, kk in blocks)
    else:
        best = max(2 * m * n * kk / peak / k.fp8().gemm_seconds(m, n, kk, fp8_peak, bandwidth, FP8_BYTES)
                   for m, n, kk in blocks)
    m, n, kk = head_gemm(w)
    best = max(best, k.gemm_efficiency(m, n, kk, peak, bandwidth, w.element_bytes))
    return max(best, k.attention_fraction * k.clock_factor if w.fused_attention else 0.0)
