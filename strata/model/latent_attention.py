"""Multi-head latent attention (MLA: DeepSeek-AI 2024, DeepSeek-V2, section 2.1; DeepSeek-V3 keeps it)
in a pre-norm block with a SwiGLU MLP: the block of DeepSeek-V2/V3's dense layers.

Keys and values come from one low-rank latent per token, c = norm(x W_kv_a), shared by every head:
each head's k_nope and v are c's up-projection (W_kv_b, per head). Positions are applied to a
separate, narrow part: qk_rope_head_dim features of each query and one key of that width shared
by every head (computed beside c by W_kv_a: the "decoupled" RoPE, which the up-projection would
otherwise mix). Queries are low-rank too when q_lora_rank > 0 (x W_q_a, normed, W_q_b), or one
projection W_q (DeepSeek-V2-Lite). Query and key heads are qk_nope + qk_rope wide, value heads
v_head_dim wide; the softmax scale is 1/sqrt(qk_nope + qk_rope).

RoPE pairs features (2i, 2i+1) when `interleaved` (DeepSeek's own weights: V2's complex rotation,
V3's rope_interleave), else halves. transformers' V3 returns the interleaved pairs de-interleaved
(evens first) and V2 keeps them in place: q and k are permuted alike, so q·k is the same either way.

The latent norms' eps is 1e-6 whatever rms_norm_eps says (transformers and DeepSeek's reference
build them with the norm's default).

Tensor parallelism, as Megatron-Core and DeepSeek place it (families/deepseek_v3.py): the down
projections (W_q_a, W_kv_a) and their norms whole on every rank (they feed every rank's heads:
gradients summed), the up projections split by heads (column), the output projection row-wise.

The block keeps the shared Block's interface (layers.AttentionBlock): `attn.core` is the core
attention selective checkpointing and context parallelism replace, `empty_kv_cache` the
generation cache, which holds the decompressed per-head keys and values (qk and v widths), not
the latent (the planner prices the latent cache, plan/inference.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from strata.model.config import ModelConfig, Shapes, linear_shapes, norm_shapes
from strata.model.layers import Attention, AttentionBlock, SwiGLU, apply_rope, make_norm

LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default, which q_a_layernorm and kv_a_layernorm keep


@dataclass(frozen=True)
class LatentShape:
    """What an MLA block computes (read from a family's options)."""
    q_lora_rank: int  # the query latent's width; 0: one projection W_q
    kv_lora_rank: int  # the key/value latent's width (what DeepSeek caches per token, with the rope key)
    qk_nope_head_dim: int  # each query and key head's features without positions
    qk_rope_head_dim: int  # ... with positions (the key's shared by every head)
    v_head_dim: int
    interleaved: bool  # RoPE on pairs (2i, 2i+1); else on halves

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, shape: LatentShape):
        super().__init__()
        d, heads, self.shape = cfg.d_model, cfg.n_heads, shape
        self.head_dim = shape.qk_head_dim  # queries' and keys' width (the interface's head_dim)
        if shape.q_lora_rank:
            self.wq_a = nn.Linear(d, shape.q_lora_rank, bias=False)
            self.q_a_norm = nn.RMSNorm(shape.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(shape.q_lora_rank, heads * shape.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(d, heads * shape.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(d, shape.kv_lora_rank + shape.qk_rope_head_dim, bias=False)
        self.kv_a_norm = nn.RMSNorm(shape.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(shape.kv_lora_rank, heads * (shape.qk_nope_head_dim + shape.v_head_dim), bias=False)
        self.wo = nn.Linear(heads * shape.v_head_dim, d, bias=False)
        # A replaced core (context parallelism's ring, its blocks) makes outputs as wide as the
        # queries: the block's hook sets this, and values are then padded to the queries' width.
        self.equal_widths = False

    def queries(self, x):
        if self.shape.q_lora_rank:
            return self.wq_b(self.q_a_norm(self.wq_a(x)))
        return self.wq(x)

    def forward(self, x, rope=None, bias=None, cache=None):
        """As layers.Attention.forward: x (batch, seq, d_model), rope's (cos, sin) from this
        position on, bias (generation's additive mask, or None), cache (update(k, v))."""
        s, (batch, seq, _) = self.shape, x.shape
        q = self.queries(x).view(batch, seq, -1, s.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.wkv_a(x).split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        kv = self.wkv_b(self.kv_a_norm(latent)).view(batch, seq, -1, s.qk_nope_head_dim + s.v_head_dim)
        k_pass, v = kv.transpose(1, 2).split([s.qk_nope_head_dim, s.v_head_dim], dim=-1)
        k_rot = k_rot.view(batch, 1, seq, s.qk_rope_head_dim)  # one rotary key for every head
        cos, sin = rope[0][..., :seq, :], rope[1][..., :seq, :]
        q = torch.cat([q_pass, self.rotate(q_rot, cos, sin)], dim=-1)
        k = torch.cat([k_pass, self.rotate(k_rot, cos, sin).expand(-1, k_pass.shape[1], -1, -1)], dim=-1)
        if cache is not None:
            k, v = cache.update(k, v)
        out = self.attend(q, k, v, bias.to(q.dtype) if isinstance(bias, torch.Tensor) else bias)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def rotate(self, x, cos, sin):
        """RoPE on (..., qk_rope_head_dim) features; the tables hold each frequency twice (halves)."""
        if not self.shape.interleaved:
            return apply_rope(x, cos, sin)
        half = cos.shape[-1] // 2
        cos, sin, even, odd = cos[..., :half], sin[..., :half], x[..., 0::2], x[..., 1::2]
        return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)  # transformers' V3 order

    def attend(self, q, k, v, bias):
        """The core attention of q and k (qk wide) with v (v wide). The one-process core takes the
        two widths as they are; a replaced one is given equal widths (zeros added to the narrower:
        to v, or to q and k with q scaled to keep the softmax scale) and its output cut back."""
        qk, width = q.shape[-1], v.shape[-1]
        if not self.equal_widths or qk == width:
            return self.core(q, k, v, bias)
        if width < qk:
            return self.core(q, k, F.pad(v, (0, qk - width)), bias)[..., :width]
        q, k = F.pad(q * math.sqrt(width / qk), (0, width - qk)), F.pad(k, (0, width - qk))
        return self.core(q, k, v, bias)

    core = Attention.core  # softmax(q kᵀ/√d_qk + bias) v, as the shared attention's


class LatentBlock(AttentionBlock):
    """Pre-norm residual block: x + mla(norm(x)), then x + swiglu(norm(x))."""

    def __init__(self, cfg: ModelConfig, shape: LatentShape, mlp: nn.Module | None = None):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = LatentAttention(cfg, shape)
        self.mlp_norm = make_norm(cfg)
        self.mlp = mlp if mlp is not None else SwiGLU(cfg)  # a family's mixture in its layers of experts

    def forward(self, x, rope=None, bias=None, cache=None):
        x = x + self.attn(self.attn_norm(x), rope, bias, cache)
        return x + self.mlp(self.mlp_norm(x))

    def empty_kv_cache(self, batch: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed decompressed keys (batch, heads, max_len, qk) and values (..., v) of the heads
        this block computes (its up-projection's output width: all, or a rank's slice)."""
        shape, weight = self.attn.shape, self.attn.wkv_b.weight
        with torch.no_grad():
            width = self.attn.wkv_b(weight.new_zeros(1, 1, weight.shape[1])).shape[-1]
        heads = width // (shape.qk_nope_head_dim + shape.v_head_dim)
        return (weight.new_zeros(batch, heads, max_len, shape.qk_head_dim),
                weight.new_zeros(batch, heads, max_len, shape.v_head_dim))

    def wrap_core_attention(self, wrap) -> None:
        self.attn.equal_widths = True  # the ring's blocks and merges are as wide as the queries
        super().wrap_core_attention(wrap)


def parameter_shapes(cfg: ModelConfig, shape: LatentShape, mixture: bool = False) -> Shapes:
    """One block's parameters, in the order LatentBlock registers them (with `mixture`, its MLP the
    mixture of experts')."""
    d, heads = cfg.d_model, cfg.n_heads
    if shape.q_lora_rank:  # the latent norms are RMSNorms: a weight each
        queries = linear_shapes("attn.wq_a", d, shape.q_lora_rank, False) + \
            [("attn.q_a_norm.weight", (shape.q_lora_rank,))] + \
            linear_shapes("attn.wq_b", shape.q_lora_rank, heads * shape.qk_head_dim, False)
    else:
        queries = linear_shapes("attn.wq", d, heads * shape.qk_head_dim, False)
    attention = queries + linear_shapes("attn.wkv_a", d, shape.kv_lora_rank + shape.qk_rope_head_dim, False) + \
        [("attn.kv_a_norm.weight", (shape.kv_lora_rank,))] + \
        linear_shapes("attn.wkv_b", shape.kv_lora_rank, heads * (shape.qk_nope_head_dim + shape.v_head_dim), False) + \
        linear_shapes("attn.wo", heads * shape.v_head_dim, d, False)
    return norm_shapes(cfg, "attn_norm", d) + attention + norm_shapes(cfg, "mlp_norm", d) + cfg.mlp_shapes(mixture)


def rotary_tables(cfg: ModelConfig, shape: LatentShape) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (max_seq_len, qk_rope_head_dim), fp64: the frequencies theta^(-2i/r) over the
    r rotary features (transformers' DeepSeek rotary embedding, head_dim = qk_rope_head_dim), each
    twice (halves; the interleaved rotation reads the first half)."""
    r = shape.qk_rope_head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def check_shape(cfg: ModelConfig, shape: LatentShape, mixtures: bool = False) -> None:
    """What an MLA block cannot compute, refused by the field that asks for it (experts only where
    the family brings its mixture)."""
    asked = {"position": cfg.position != "rope", "mlp": cfg.mlp != "swiglu", "norm": cfg.norm != "rmsnorm",
             "n_experts": cfg.moe and not mixtures, "bias": cfg.bias, "qkv_bias": cfg.qkv_bias, "qk_norm": cfg.qk_norm,
             "sliding_window": cfg.sliding_window is not None, "rope_type": cfg.rope_type != "default"}
    for name, refused in asked.items():
        if refused:
            raise ValueError(f"{name}={getattr(cfg, name)!r}: a {cfg.family} block does not compute it")
    if cfg.kv_heads != cfg.n_heads:
        raise ValueError(f"n_kv_heads={cfg.n_kv_heads}: latent attention has a key and a value per query head")
    if cfg.d_head not in (None, shape.qk_head_dim):  # None: the block's widths are its options' alone
        raise ValueError(f"d_head={cfg.d_head} must be qk_nope_head_dim + qk_rope_head_dim = {shape.qk_head_dim}")


def described(shape_of, check, mixture_of=None, moe_layer=None, buffer_shapes=None) -> dict:
    """The fields of an OwnBlock (families/base.py) for a family whose block is this one, its
    LatentShape read from a config by shape_of; check: the family's check of its options;
    mixture_of(cfg, router_losses): the MLP of the layers whose moe_layer(cfg, layer) holds, with
    buffer_shapes(cfg, layer)'s buffers."""
    def make(cfg: ModelConfig, router_losses=None, layer: int = 0) -> nn.Module:
        mlp = mixture_of(cfg, router_losses) if cfg.layer_is_moe(layer) else None
        return LatentBlock(cfg, shape_of(cfg), mlp)

    def checked(cfg: ModelConfig) -> None:
        check(cfg)
        check_shape(cfg, shape_of(cfg), mixture_of is not None)
    return dict(make=make, check=checked, moe_layer=moe_layer, buffer_shapes=buffer_shapes,
                parameter_shapes=lambda cfg, layer: parameter_shapes(cfg, shape_of(cfg), cfg.layer_is_moe(layer)),
                rope_tables=lambda cfg: rotary_tables(cfg, shape_of(cfg)),
                attention_products=lambda cfg, seq_len: attention_products(cfg, shape_of(cfg), seq_len))


def attention_products(cfg: ModelConfig, shape: LatentShape, seq_len: int) -> int:
    """Scores over q/k heads qk_nope + qk_rope wide, values v_head_dim wide, over every position."""
    return cfg.n_layers * cfg.n_heads * (shape.qk_head_dim + shape.v_head_dim) * seq_len
