"""The pieces a transformer is built from. Each is plain PyTorch for one device; a parallel module
replaces some of them (tensor parallelism swaps the linear layers) without the model knowing.

Head counts are read from the weight shapes at run time, so a layer whose projections hold only a
slice of the heads (tensor parallelism) works unchanged."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from strata.model.config import ModelConfig


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)


# --- positions -----------------------------------------------------------------------------------
def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (max_seq_len, head_dim), in the "rotate half" layout that Hugging Face
    LLaMA checkpoints use, so weights convert without permuting rows."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); cos/sin: (seq, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Per-head slopes of ALiBi (Press et al. 2022), including the rule for head counts that are
    not a power of two that BLOOM uses."""
    def powers(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]
    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = powers(closest)
    if closest < n_heads:
        slopes += powers(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float64)


# --- attention -----------------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        kv_dim = cfg.kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.wk = nn.Linear(cfg.d_model, kv_dim, bias=cfg.bias)
        self.wv = nn.Linear(cfg.d_model, kv_dim, bias=cfg.bias)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x, rope=None, bias=None, cache=None):
        """x: (batch, seq, d_model). rope: (cos, sin) from this position on, (positions, head_dim),
        or per row (batch, 1, seq, head_dim). bias: the additive mask from `attention_bias`, or
        None for plain causal attention. cache: a per-layer KV cache with
        `.update(k, v) -> (keys, values)`."""
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            cos, sin = rope[0][..., :seq, :], rope[1][..., :seq, :]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v)
        out = self.core(q, k, v, bias if bias is None else bias.to(q.dtype))
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def core(self, q, k, v, bias):
        """softmax(q kᵀ/√d + bias) v: the "core attention" that selective checkpointing recomputes.
        Without a bias, causal (a single query sees every key)."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=bias is None and q.shape[2] > 1,
                                              enable_gqa=q.shape[1] != k.shape[1])


def attention_bias(q_len: int, start: int, pad: torch.Tensor | None, alibi: torch.Tensor | None,
                   dtype, device) -> torch.Tensor | None:
    """The additive mask for queries at slots start .. start + q_len - 1 over keys at slots
    0 .. start + q_len - 1: -inf above the causal diagonal and, for a real query, on its row's
    padding slots (pad[row] left-padding slots, in generation); plus ALiBi's distance penalty
    (slot distances equal position distances: padding is a shift). None when plain causal
    attention does it: no padding, no ALiBi, and a fresh sequence or a single query."""
    if pad is None and alibi is None and (start == 0 or q_len == 1):
        return None
    k_len = start + q_len
    q_slot = torch.arange(start, k_len, device=device)[:, None]
    k_slot = torch.arange(k_len, device=device)[None, :]
    hidden = k_slot > q_slot  # (q, k)
    if pad is not None:  # a padding query may see earlier padding, so its row stays finite
        k_padding = k_slot < pad[:, None, None]  # (batch, 1, k)
        q_real = q_slot >= pad[:, None, None]  # (batch, q, 1)
        hidden = (hidden | (k_padding & q_real))[:, None]  # (batch, 1, q, k)
    bias = torch.zeros(hidden.shape, dtype=dtype, device=device)
    if alibi is not None:
        bias = bias + alibi.to(dtype)[:, None, None] * (k_slot - q_slot).to(dtype)
    return bias.masked_fill(hidden, float("-inf"))


# --- feed-forward --------------------------------------------------------------------------------
class SwiGLU(nn.Module):
    """LLaMA's MLP: down(silu(gate(x)) * up(x)) (Shazeer 2020)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.w_up = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.w_down = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class GeluMLP(nn.Module):
    """GPT-2's MLP, with the tanh approximation of GELU that GPT-2 was trained with."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_in = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.w_out = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)

    def forward(self, x):
        return self.w_out(F.gelu(self.w_in(x), approximate="tanh"))


class CrossEntropy(nn.Module):
    """The loss, as a layer so that a parallel version (vocabulary-split logits) can replace it."""

    def forward(self, logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = SwiGLU(cfg) if cfg.mlp == "swiglu" else GeluMLP(cfg)

    def forward(self, x, rope=None, bias=None, cache=None):
        x = x + self.attn(self.attn_norm(x), rope, bias, cache)
        return x + self.mlp(self.mlp_norm(x))
