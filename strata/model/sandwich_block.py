"""The block of Gemma 2 and 3 (Google 2024, 2025) and OLMo 2 (OLMo et al. 2024): a norm after each
sub-block's output, before it joins the residual stream,

    h = x + post_attn_norm(attn(attn_norm(x)))         Gemma 2 and 3: four norms (a "sandwich")
    y = h + post_mlp_norm(mlp(mlp_norm(h)))
    h = x + post_attn_norm(attn(x))                    OLMo 2: the norms after only
    y = h + post_mlp_norm(mlp(h))

with, as the family's options say, q/k norms (Gemma 3's over each head, OLMo 2's over the whole q
and k projections), attention scores scaled by 1/sqrt(query_pre_attn_scalar) and soft-capped,
cap · tanh(scores / cap) (Gemma 2), and local layers (a sliding window, and in Gemma 3 a RoPE base
of their own) alternating with global ones by a repeating pattern (transformers' layer_types).

What a family's options make of it is a `SandwichShape` (families/gemma2.py, gemma3.py, olmo2.py).
The block keeps the shared Block's interface (families/base.OwnBlock: attn.wq/wk/wv/wo, attn.core,
attn_norm, mlp_norm and mlp.* where they exist) and names its norms after the sub-block
post_attn_norm and post_mlp_norm; OLMo 2, having no norm before a sub-block, carries an identity
in its place (attn_input, mlp_input) for tensor parallelism's input conversion to follow.

The soft-capped core attention is computed here (no fused kernel of PyTorch's caps the scores;
FlashAttention 2 can, outside it), by tiles of queries whose scores are made again in backward,
so that no S x S matrix is kept; context parallelism's ring, which merges fused kernels' blocks,
cannot cap them either (refused before processes start: `context_refusal`).
The model's ModelConfig.sliding_window stays None: a window belongs to the local layers only, so
each local block masks it itself (in training a CausalMask, in generation an additive mask)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from strata.model.attention_blocks import TILE_ELEMENTS, CausalMask, as_attention_computes, to_kv_heads
from strata.model.config import ModelConfig, Shapes, linear_shapes, norm_shapes
from strata.model.layers import Attention, AttentionBlock, GeGLU, SwiGLU, attention_bias, make_norm, rope_frequencies

QK_NORMS = ("none", "head", "projection")  # none; over each head's features (Gemma 3); over all of q or k (OLMo 2)
LOCAL, GLOBAL = "L", "G"  # a layer type in SandwichShape.layer_types


@dataclass(frozen=True)
class SandwichShape:
    """What a sandwich block computes (read from a family's options); 0 turns a number off."""
    pre_norms: bool  # norms before each sub-block too (Gemma); OLMo 2 has only those after
    qk_norm: str  # one of QK_NORMS
    attention_bias: bool  # biases on q, k, v and the output projection
    query_scalar: float  # scores are q·k / sqrt(query_scalar) (Gemma's query_pre_attn_scalar; else head_dim)
    attn_softcap: float  # scores -> cap · tanh(scores / cap) before the mask (Gemma 2: 50); 0: none
    window: int  # a local layer's query sees the keys fewer than `window` positions back; 0: none
    layer_types: str  # LOCAL or GLOBAL per layer, repeating: layer i is layer_types[i % len] ("LG": Gemma 2)
    local_rope_theta: float  # the local layers' RoPE base (Gemma 3's rope_local_base_freq); 0: the model's
    rope_factor: float = 1.0  # the global layers' linear RoPE scaling (positions / factor; Gemma 3 4B+: 8)

    def is_local(self, layer: int) -> bool:
        """Whether this layer attends through the window."""
        return bool(self.window) and self.layer_types[layer % len(self.layer_types)] == LOCAL

    def windowed(self) -> bool:
        """Whether some layer attends through a window."""
        return bool(self.window) and LOCAL in self.layer_types

    def own_local_rope(self) -> bool:
        """Whether local layers read rotary tables of their own (another base than the global ones)."""
        return bool(self.local_rope_theta) and LOCAL in self.layer_types


# --- attention -----------------------------------------------------------------------------------
class SandwichAttention(Attention):
    """The shared attention with the family's q/k norms, its scale and soft cap, and this layer's
    window and rotary tables."""

    def __init__(self, cfg: ModelConfig, shape: SandwichShape, layer: int):
        super().__init__(cfg, qkv_bias=shape.attention_bias, out_bias=shape.attention_bias)
        self.qk_norm, self.softcap = shape.qk_norm, shape.attn_softcap
        self.window = shape.window if shape.is_local(layer) else None
        # q·k/sqrt(query_scalar) = (c·q)·k/sqrt(head_dim): q scaled once, every core keeps its own scale
        self.query_scale = None if shape.query_scalar == cfg.head_dim else math.sqrt(cfg.head_dim / shape.query_scalar)
        # the columns of the model's rotary tables this layer reads (local ones after the global ones)
        own_local = shape.own_local_rope() and self.window is not None
        self.rope_columns = slice(cfg.head_dim, 2 * cfg.head_dim) if own_local else slice(0, cfg.head_dim)
        if shape.qk_norm != "none":
            width_q, width_k = (cfg.head_dim, cfg.head_dim) if shape.qk_norm == "head" else \
                (cfg.q_dim, cfg.kv_heads * cfg.head_dim)
            self.q_norm, self.k_norm = make_norm(cfg, width_q), make_norm(cfg, width_k)

    def forward(self, x, rope=None, bias=None, cache=None):
        batch, seq, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.qk_norm == "projection":  # over every head's features together (OLMo 2)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.view(batch, seq, -1, self.head_dim) for t in (q, k, v))
        if self.qk_norm == "head":  # over each head's features (Gemma 3)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if rope is not None:
            cos, sin = (table[..., :seq, self.rope_columns] for table in rope)
            q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        if self.query_scale is not None:
            q = q * self.query_scale
        if cache is not None:
            k, v = cache.update(k, v)
        if isinstance(bias, torch.Tensor):
            bias = bias.to(q.dtype)
        out = self.core(q, k, v, self.with_window(bias, q, k.shape[2], cache is not None))
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def with_window(self, bias, q, keys: int, cached: bool):
        """The model's mask (None, or generation's additive one) with this layer's window added:
        a CausalMask in training, an additive mask over the cache's slots in generation."""
        if self.window is None:
            return bias
        if not cached and bias is None:
            return CausalMask(self.window)
        window = attention_bias(q.shape[2], keys - q.shape[2], None, None, q.dtype, q.device, self.window)
        if window is None:
            return bias
        return window if bias is None else bias + window

    def core(self, q, k, v, bias):
        if not self.softcap:
            return super().core(q, k, v, bias)
        return capped_attention(q, k, v, bias, self.softcap)


def capped_attention(q, k, v, bias, cap: float, tile_elements: int = TILE_ELEMENTS) -> torch.Tensor:
    """softmax(cap · tanh(q kᵀ / (cap·√d)) + mask) v, the scores in fp32 at least (transformers'
    eager Gemma 2 attention), for queries (batch, heads, Lq, d) and keys and values (batch,
    kv_heads, Lk, d). bias: generation's additive mask (all the scores at once: a few queries), or
    None / a CausalMask: causal, the queries being the last Lq of the keys, within its window, by
    tiles of queries of at most `tile_elements` scores, none of them kept for backward."""
    if isinstance(bias, torch.Tensor):
        scores = cap * torch.tanh(_scores(q, _per_query_head(k, q), torch.promote_types(q.dtype, torch.float32)) / cap)
        weights = F.softmax(scores + bias.to(scores.dtype), dim=-1)
        return weights.to(v.dtype) @ _per_query_head(v, q)
    window = bias.window if isinstance(bias, CausalMask) else None
    q, k, v = as_attention_computes(q, k, v)
    with torch.autocast(q.device.type, enabled=False):  # the tiles' arithmetic is chosen here
        return _CappedAttention.apply(q, k, v, window, cap, tile_elements)


def _per_query_head(t: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """K or V repeated to one head per query head (grouped-query attention)."""
    return t.repeat_interleave(q.shape[1] // t.shape[1], dim=1)


def _scores(q, keys, dtype) -> torch.Tensor:
    return q.to(dtype) @ keys.to(dtype).transpose(-1, -2) / math.sqrt(q.shape[-1])


def _query_tiles(q, keys: int, tile_elements: int):
    """Slices of the queries whose scores hold at most tile_elements numbers (one row at least)."""
    rows = max(1, min(q.shape[2], tile_elements // (q.shape[0] * q.shape[1] * keys)))
    return [slice(start, min(start + rows, q.shape[2])) for start in range(0, q.shape[2], rows)]


def _capped_tile(q, keys, rows: slice, window, cap: float, dtype):
    """A tile of queries' capped, masked scores, and tanh of the raw ones (for backward)."""
    capped = torch.tanh(_scores(q[:, :, rows], keys, dtype) / cap)
    start = keys.shape[2] - q.shape[2]  # the queries are the last of the keys
    q_slot = torch.arange(start + rows.start, start + rows.stop, device=q.device)[:, None]
    k_slot = torch.arange(keys.shape[2], device=q.device)[None, :]
    hidden = (k_slot > q_slot) | ((k_slot <= q_slot - window) if window is not None else False)
    return (cap * capped).masked_fill(hidden, float("-inf")), capped


class _CappedAttention(torch.autograd.Function):
    """Causal soft-capped attention by tiles of queries: forward keeps the output and each query's
    log-sum-exp (as FlashAttention does), backward recomputes each tile's probabilities from them,
    the cap's derivative being 1 - tanh²."""

    @staticmethod
    def forward(ctx, q, k, v, window, cap, tile_elements):
        dtype = torch.promote_types(q.dtype, torch.float32)
        keys, values = _per_query_head(k, q), _per_query_head(v, q).to(dtype)
        out, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=dtype, device=q.device)
        for rows in _query_tiles(q, keys.shape[2], tile_elements):
            scores, _ = _capped_tile(q, keys, rows, window, cap, dtype)
            lse[:, :, rows] = torch.logsumexp(scores, dim=-1)
            out[:, :, rows] = (torch.exp(scores - lse[:, :, rows, None]) @ values).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.window, ctx.cap, ctx.tile_elements = window, cap, tile_elements
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dtype, scale = lse.dtype, 1.0 / math.sqrt(q.shape[-1])
        keys, values = _per_query_head(k, q).to(dtype), _per_query_head(v, q).to(dtype)
        dq = torch.empty(q.shape, dtype=dtype, device=q.device)
        dk, dv = torch.zeros_like(keys), torch.zeros_like(values)
        for rows in _query_tiles(q, keys.shape[2], ctx.tile_elements):
            scores, capped = _capped_tile(q, keys, rows, ctx.window, ctx.cap, dtype)
            p = torch.exp(scores - lse[:, :, rows, None])
            d_out = grad_out[:, :, rows].to(dtype)
            dv += p.transpose(-1, -2) @ d_out
            d_capped = p * (d_out @ values.transpose(-1, -2) -
                            (d_out * out[:, :, rows].to(dtype)).sum(-1, keepdim=True))
            d_raw = d_capped * (1 - capped * capped) * scale
            dq[:, :, rows] = d_raw @ keys
            dk += d_raw.transpose(-1, -2) @ q[:, :, rows].to(dtype)
        dk, dv = to_kv_heads(dk, k.shape[1]), to_kv_heads(dv, v.shape[1])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


# --- the block -----------------------------------------------------------------------------------
class SandwichBlock(AttentionBlock):
    def __init__(self, cfg: ModelConfig, shape: SandwichShape, layer: int):
        super().__init__()
        self.pre_norms = shape.pre_norms
        if shape.pre_norms:
            self.attn_norm = make_norm(cfg)
        else:
            self.attn_input = nn.Identity()  # where tensor parallelism's input conversion hangs
        self.attn = SandwichAttention(cfg, shape, layer)
        self.post_attn_norm = make_norm(cfg)
        if shape.pre_norms:
            self.mlp_norm = make_norm(cfg)
        else:
            self.mlp_input = nn.Identity()
        self.mlp = GeGLU(cfg) if cfg.mlp == "geglu" else SwiGLU(cfg)
        self.post_mlp_norm = make_norm(cfg)

    def forward(self, x, rope=None, bias=None, cache=None):
        attended = self.attn(self.attn_norm(x) if self.pre_norms else self.attn_input(x), rope, bias, cache)
        h = x + self.post_attn_norm(attended)
        return h + self.post_mlp_norm(self.mlp(self.mlp_norm(h) if self.pre_norms else self.mlp_input(h)))

    def empty_kv_cache(self, batch: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared block's, with the KV heads this rank keeps: under tensor parallelism with
        fewer KV heads than ranks, OLMo 2's K is computed whole for its norm, which keeps this
        rank's heads (strata/parallel/tensor.py: `kept_rows`)."""
        keys, values = super().empty_kv_cache(batch, max_len)
        rows = getattr(getattr(self.attn, "k_norm", None), "kept_rows", None)
        if rows is None:
            return keys, values
        heads = slice(rows.start // self.attn.head_dim, rows.stop // self.attn.head_dim)
        return keys[:, heads].contiguous(), values[:, heads].contiguous()


def parameter_shapes(cfg: ModelConfig, shape: SandwichShape) -> Shapes:
    """One block's parameters, in the order SandwichBlock registers them."""
    d, kv_dim, bias = cfg.d_model, cfg.kv_heads * cfg.head_dim, shape.attention_bias
    pre = (lambda path: norm_shapes(cfg, path, d)) if shape.pre_norms else (lambda path: [])
    shapes = pre("attn_norm") + linear_shapes("attn.wq", d, cfg.q_dim, bias) + \
        linear_shapes("attn.wk", d, kv_dim, bias) + linear_shapes("attn.wv", d, kv_dim, bias) + \
        linear_shapes("attn.wo", cfg.q_dim, d, bias)
    if shape.qk_norm != "none":
        head = shape.qk_norm == "head"
        shapes += norm_shapes(cfg, "attn.q_norm", cfg.head_dim if head else cfg.q_dim) + \
            norm_shapes(cfg, "attn.k_norm", cfg.head_dim if head else kv_dim)
    mlp = [s for name in ("mlp.w_gate", "mlp.w_up") for s in linear_shapes(name, d, cfg.d_ff, False)] + \
        linear_shapes("mlp.w_down", cfg.d_ff, d, False)
    return shapes + norm_shapes(cfg, "post_attn_norm", d) + pre("mlp_norm") + mlp + \
        norm_shapes(cfg, "post_mlp_norm", d)


def rotary_tables(cfg: ModelConfig, shape: SandwichShape) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (max_seq_len, head_dim) in fp64, "rotate half" layout: the global layers'
    (layers.rope_frequencies, divided by rope_factor: transformers' "linear" RoPE), followed by the
    local layers' (base local_rope_theta, unscaled) when they have their own: (max_seq_len, 2 · head_dim)."""
    def table(inv_freq: torch.Tensor) -> torch.Tensor:
        angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv_freq)
        return torch.cat([angles, angles], dim=-1)
    angles = table(rope_frequencies(cfg) / shape.rope_factor)  # Llama 3.1's scaling too, where given
    if shape.own_local_rope():
        angles = torch.cat([angles, table(rope_frequencies(replace(cfg, rope_theta=shape.local_rope_theta, rope_type="default")))], dim=-1)
    return angles.cos(), angles.sin()


def context_refusal(shape: SandwichShape) -> str | None:
    """Why context parallelism cannot split this model's attention (None: it can): its ring merges
    fused kernels' blocks, which neither soft-cap the scores nor take a window per layer."""
    if shape.attn_softcap:
        return f"attention logit soft-capping (cap {shape.attn_softcap:g}): no fused kernel of the ring applies it"
    if shape.windowed():
        return "a sliding window on some layers only (layer_types): the ring applies one window to every layer"
    return None


def check_shape(cfg: ModelConfig, shape: SandwichShape) -> None:
    """What the sandwich block cannot compute, refused by the field that asks for it: the shared
    Block's own options (the window is the family's, on its local layers), and its own values."""
    asked = {"position": cfg.position != "rope", "mlp": cfg.mlp not in ("geglu", "swiglu"), "n_experts": cfg.moe,
             "qkv_bias": cfg.qkv_bias, "qk_norm": cfg.qk_norm, "sliding_window": cfg.sliding_window is not None,
             "norm": cfg.norm == "layernorm"}
    for name, refused in asked.items():
        if refused:
            raise ValueError(f"{name}={getattr(cfg, name)!r}: a {cfg.family} block does not compute it")
    if shape.qk_norm not in QK_NORMS:
        raise ValueError(f"a {cfg.family} block's q/k norm is one of {', '.join(QK_NORMS)}, not {shape.qk_norm!r}")
    if not shape.layer_types or set(shape.layer_types) - {LOCAL, GLOBAL}:
        raise ValueError(f"layer_types={shape.layer_types!r}: one of {LOCAL!r} (local) or {GLOBAL!r} (global) "
                         f"per layer, repeating")
    for name in ("query_scalar", "rope_factor"):
        if not getattr(shape, name) > 0:
            raise ValueError(f"{name}={getattr(shape, name)!r} must be a positive number")
    for name in ("attn_softcap", "window", "local_rope_theta"):
        if getattr(shape, name) < 0:
            raise ValueError(f"{name}={getattr(shape, name)!r} must be 0 (none) or a positive number")


def described(shape_of, check) -> dict:
    """The fields of an OwnBlock (families/base.py) for a family whose block is this one, its
    SandwichShape read from a config by shape_of; check: the family's check of its options."""
    def make(cfg: ModelConfig, router_losses=None, layer: int = 0) -> nn.Module:
        return SandwichBlock(cfg, shape_of(cfg), layer)

    def checked(cfg: ModelConfig) -> None:
        check(cfg)
        check_shape(cfg, shape_of(cfg))
    return dict(make=make, parameter_shapes=lambda cfg, layer: parameter_shapes(cfg, shape_of(cfg)), check=checked,
                rope_tables=lambda cfg: rotary_tables(cfg, shape_of(cfg)),
                context_refusal=lambda cfg: context_refusal(shape_of(cfg)),
                attention_products=lambda cfg, seq_len: attention_products(cfg, shape_of(cfg), seq_len))


def attention_products(cfg: ModelConfig, shape: SandwichShape, seq_len: int) -> int:
    """heads x 2·head_dim x the positions each layer attends: a local layer its window at most."""
    return sum(cfg.n_heads * 2 * cfg.head_dim * (min(seq_len, shape.window) if shape.is_local(layer) else seq_len)
               for layer in range(cfg.n_layers))
