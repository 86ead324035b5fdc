"""The pieces a transformer is built from. Each is plain PyTorch for one device; a parallel module
replaces some of them (tensor parallelism swaps the linear layers) without the model knowing.

Head counts are read from the weight shapes at run time, so a layer whose projections hold only a
slice of the heads (tensor parallelism) works unchanged."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from strata.model.attention_blocks import CausalMask, causal_attention
from strata.model.config import ModelConfig
from strata.model.moe import MoE, RouterLosses


def make_norm(cfg: ModelConfig, width: int | None = None) -> nn.Module:
    """The model's norm over `width` features (d_model unless given: a head's q and k)."""
    width = width or cfg.d_model
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(width, eps=cfg.norm_eps)
    if cfg.norm == "gemma_rmsnorm":
        return GemmaRMSNorm(width, eps=cfg.norm_eps)
    return nn.LayerNorm(width, eps=cfg.norm_eps)


class GemmaRMSNorm(nn.Module):
    """RMSNorm that scales by (1 + weight), the weight stored as Gemma's checkpoints store it (0
    means scale 1), computed in at least fp32 and cast back after scaling (transformers'
    GemmaRMSNorm: "Llama does x.to(float16) * w whilst Gemma is (x * w).to(float16)")."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x):
        compute = torch.promote_types(x.dtype, torch.float32)  # fp64 training stays fp64
        h = x.to(compute)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.to(compute))).to(x.dtype)


# --- positions -----------------------------------------------------------------------------------
def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """The rotation frequency of each pair of a head's features, (head_dim / 2,) in fp64; with
    rope_type "llama3", scaled as transformers' `_compute_llama3_parameters` does (Llama 3.1):
    wavelengths 2π/f shorter than C/high_freq_factor keep f, longer than C/low_freq_factor take
    f/factor, and those between blend the two, C being the original context."""
    head_dim = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if cfg.rope_type != "llama3":
        return inv_freq
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    context = cfg.rope_original_max_seq_len
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = ~(wavelength < context / high) & ~(wavelength > context / low)
    return torch.where(between, blended, scaled)


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (max_seq_len, head_dim), in the "rotate half" layout that Hugging Face
    LLaMA checkpoints use, so weights convert without permuting rows."""
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), rope_frequencies(cfg))
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
    def __init__(self, cfg: ModelConfig, qkv_bias: bool | None = None, out_bias: bool | None = None):
        """qkv_bias, out_bias: biases on q, k, v and on the output projection (None: as the
        config's options say; a family's own block says itself)."""
        super().__init__()
        self.head_dim = cfg.head_dim
        kv_dim = cfg.kv_heads * cfg.head_dim
        qkv_bias = (cfg.bias or cfg.qkv_bias) if qkv_bias is None else qkv_bias
        out_bias = cfg.bias if out_bias is None else out_bias
        self.wq = nn.Linear(cfg.d_model, cfg.q_dim, bias=qkv_bias)
        self.wk = nn.Linear(cfg.d_model, kv_dim, bias=qkv_bias)
        self.wv = nn.Linear(cfg.d_model, kv_dim, bias=qkv_bias)
        self.wo = nn.Linear(cfg.q_dim, cfg.d_model, bias=out_bias)
        # Qwen3: one norm over each head's features, shared by all heads, before RoPE
        # (transformers' Qwen3Attention applies q_norm to q_proj(x).view(..., head_dim)).
        self.q_norm = make_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, cfg.head_dim) if cfg.qk_norm else None

    def forward(self, x, rope=None, bias=None, cache=None):
        """x: (batch, seq, d_model). rope: (cos, sin) from this position on, (positions, head_dim),
        or per row (batch, 1, seq, head_dim). bias: the additive mask from `attention_bias`
        (generation), a CausalMask (a window or ALiBi in training), or None for plain causal attention. cache: a per-layer KV cache with
        `.update(k, v) -> (keys, values)`."""
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            cos, sin = rope[0][..., :seq, :], rope[1][..., :seq, :]
            q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v)
        out = self.core(q, k, v, bias.to(q.dtype) if isinstance(bias, torch.Tensor) else bias)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def rotate(self, x, cos, sin):
        """RoPE on queries or keys (batch, heads, seq, head_dim): here every feature of a head in the
        "rotate half" layout; a family's own attention may rotate otherwise (strata/model/parallel_block.py)."""
        return apply_rope(x, cos, sin)

    def core(self, q, k, v, bias):
        """softmax(q kᵀ/√d + bias) v: the "core attention" that selective checkpointing recomputes.
        Without a bias, causal (a single query sees every key); a CausalMask: by blocks, without an
        S x S mask (strata/model/attention_blocks.py)."""
        if bias is None or isinstance(bias, CausalMask):
            return causal_attention(q, k, v, bias)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=q.shape[1] != k.shape[1])


def attention_bias(q_len: int, start: int, pad: torch.Tensor | None, alibi: torch.Tensor | None,
                   dtype, device, window: int | None = None) -> torch.Tensor | None:
    """The additive mask for queries at slots start .. start + q_len - 1 over keys at slots
    0 .. start + q_len - 1: -inf above the causal diagonal, with a sliding window on keys W or
    more slots back (transformers' sliding_window_overlay: key > query - W), and, for a real
    query, on its row's padding slots (pad[row] left-padding slots, in generation); plus ALiBi's
    distance penalty (slot distances equal position distances: padding is a shift). None when
    plain causal attention does it: no padding, no ALiBi, no window reached, and a fresh sequence
    or a single query."""
    k_len = start + q_len
    windowed = window is not None and k_len > window
    if pad is None and alibi is None and not windowed and (start == 0 or q_len == 1):
        return None
    q_slot = torch.arange(start, k_len, device=device)[:, None]
    k_slot = torch.arange(k_len, device=device)[None, :]
    hidden = k_slot > q_slot  # (q, k)
    if windowed:
        hidden = hidden | (k_slot <= q_slot - window)
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


class GeGLU(SwiGLU):
    """Gemma's MLP: SwiGLU's layout with the tanh GELU as the gate (transformers' GemmaMLP with
    hidden_act gelu_pytorch_tanh)."""

    def forward(self, x):
        return self.w_down(F.gelu(self.w_gate(x), approximate="tanh") * self.w_up(x))


class GeluMLP(nn.Module):
    """GPT-2's MLP, with the tanh approximation of GELU that GPT-2 was trained with (approximate
    "none": the exact GELU, as GPT-NeoX's "gelu"). bias: None as the config says."""

    def __init__(self, cfg: ModelConfig, bias: bool | None = None, approximate: str = "tanh"):
        super().__init__()
        bias = cfg.bias if bias is None else bias
        self.approximate = approximate
        self.w_in = nn.Linear(cfg.d_model, cfg.d_ff, bias=bias)
        self.w_out = nn.Linear(cfg.d_ff, cfg.d_model, bias=bias)

    def forward(self, x):
        return self.w_out(F.gelu(self.w_in(x), approximate=self.approximate))


class CrossEntropy(nn.Module):
    """The loss, as a layer so that a parallel version (vocabulary-split logits) can replace it.
    forward: the mean over tokens of whole logits; token_losses and mean: the same loss from the
    chunks of the sequence strata/model/loss.py computes one at a time."""

    def forward(self, logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def token_losses(self, logits, targets):
        """Each token's loss, in fp32 at least (the softmax's sums want it)."""
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")

    def mean(self, total, targets):
        """The mean loss from the sum of every token's."""
        return total / targets.numel()


class AttentionBlock(nn.Module):
    """What every block offers the rest of strata beside its forward(x, rope, bias, cache): its
    attention as `self.attn` (an Attention: `wk`, `head_dim`, `core`), read here for the KV cache
    and the core-attention hook. The shared Block and a family's own blocks derive from it."""

    def empty_kv_cache(self, batch: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed keys and values for generation, (batch, kv_heads, max_len, head_dim) each, with
        the KV heads this block computes (all, a slice, or those its query heads read under tensor
        parallelism: the projection's own output width, whatever layer implements it)."""
        attn, weight = self.attn, self.attn.wk.weight
        with torch.no_grad():
            kv_heads = attn.wk(weight.new_zeros(1, 1, weight.shape[1])).shape[-1] // attn.head_dim
        shape = (batch, kv_heads, max_len, attn.head_dim)
        return (torch.zeros(shape, dtype=weight.dtype, device=weight.device),
                torch.zeros(shape, dtype=weight.dtype, device=weight.device))

    def wrap_core_attention(self, wrap) -> None:
        """Selective checkpointing's and context parallelism's hook: the core attention becomes
        wrap(core attention)."""
        self.attn.core = wrap(self.attn.core)


class Block(AttentionBlock):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, router_losses: RouterLosses | None = None, moe: bool | None = None):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        mixture = cfg.moe if moe is None else moe  # (a family's layers may alternate: families/mixtral.py)
        self.mlp = MoE(cfg, router_losses) if mixture else {"swiglu": SwiGLU, "geglu": GeGLU, "gelu": GeluMLP}[cfg.mlp](cfg)

    def forward(self, x, rope=None, bias=None, cache=None):
        x = x + self.attn(self.attn_norm(x), rope, bias, cache)
        return x + self.mlp(self.mlp_norm(x))
