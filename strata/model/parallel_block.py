"""The parallel block of GPT-J (Wang & Komatsuzaki 2021), GPT-NeoX (Black et al. 2022) and Falcon
(Almazrouei et al. 2023): attention and the MLP read the same residual stream and add to it together,

    x + attn(ln_1(x)) + mlp(ln_2(x))        GPT-NeoX (use_parallel_residual), Falcon-40B (ln_attn, ln_mlp)
    x + attn(ln(x)) + mlp(ln(x))            GPT-J, Falcon-7B: one norm for both

(GPT-NeoX without the parallel residual, Falcon's first releases: the shared Block's order,
x + attn(ln_1(x)), then + mlp), with rotary positions on the first features of each head (all of
them: Falcon), in GPT-J's interleaved pairs (rotate_every_two) or GPT-NeoX's two halves
(rotate_half over the rotated part), and the exact or tanh GELU in an MLP with biases (Falcon's
without, as its attention's). The K/V heads are the config's n_kv_heads (Falcon's multi-query and
grouped attention).

What a family's options make of it is a `ParallelShape` (families/gptj.py, families/gpt_neox.py,
families/falcon.py read their options into one). The block keeps the shared Block's interface and module names
(attn_norm, attn.wq/wk/wv/wo, mlp_norm, mlp.w_in/w_out): every placement, hook and count reads it
as it reads the shared Block (families/base.OwnBlock). Under tensor parallelism GPT-J's one norm
feeds both column-parallel groups: its one input conversion serves them both (the gradients of
the two groups arrive summed at it), and each row-parallel output is reduced on its own."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from strata.model.config import ModelConfig, Shapes, linear_shapes, norm_shapes
from strata.model.layers import Attention, AttentionBlock, GeluMLP, apply_rope, make_norm


@dataclass(frozen=True)
class ParallelShape:
    """What a parallel block computes (read from a family's options)."""
    rotary_dim: int  # n: the frequencies are theta^(-2i/n), i < n/2 rounded up; 2·that many features rotate
    interleaved: bool  # GPT-J's pairs (2i, 2i + 1); else GPT-NeoX's halves of the rotated part
    parallel: bool  # attention and MLP from one residual; else one after the other
    one_norm: bool  # GPT-J: the attention's norm feeds the MLP too
    attention_bias: bool  # biases on q, k, v and the output projection
    gelu: str  # "none": the exact GELU; "tanh": its tanh approximation
    mlp_bias: bool = True  # biases on the MLP's two matrices (GPT-J's and GPT-NeoX's; Falcon's per its `bias`)

    def rotated(self) -> int:
        """The features of each head that rotate (transformers': the width of its cos table)."""
        return 2 * ((self.rotary_dim + 1) // 2)


class PartialRotaryAttention(Attention):
    """The shared attention with RoPE on the first features of each head: the rotary tables'
    width (ParallelShape.rotated) of them rotate, the rest pass unchanged."""

    def __init__(self, cfg: ModelConfig, shape: ParallelShape):
        super().__init__(cfg, qkv_bias=shape.attention_bias, out_bias=shape.attention_bias)
        self.interleaved = shape.interleaved

    def rotate(self, x, cos, sin):
        width = cos.shape[-1]
        turned = x[..., :width]
        turned = turned * cos + every_two(turned) * sin if self.interleaved else apply_rope(turned, cos, sin)
        return torch.cat([turned, x[..., width:]], dim=-1)


def every_two(x: torch.Tensor) -> torch.Tensor:
    """GPT-J's rotate_every_two: (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


class ParallelBlock(AttentionBlock):
    def __init__(self, cfg: ModelConfig, shape: ParallelShape):
        super().__init__()
        self.parallel = shape.parallel
        self.attn_norm = make_norm(cfg)
        self.attn = PartialRotaryAttention(cfg, shape)
        self.mlp_norm = None if shape.one_norm else make_norm(cfg)
        self.mlp = GeluMLP(cfg, bias=shape.mlp_bias, approximate=shape.gelu)

    def forward(self, x, rope=None, bias=None, cache=None):
        normed = self.attn_norm(x)
        attended = self.attn(normed, rope, bias, cache)
        if not self.parallel:
            x = x + attended
            return x + self.mlp(self.mlp_norm(x))
        return x + attended + self.mlp(normed if self.mlp_norm is None else self.mlp_norm(x))


def parameter_shapes(cfg: ModelConfig, shape: ParallelShape) -> Shapes:
    """One block's parameters, in the order ParallelBlock registers them."""
    d, kv_dim, bias = cfg.d_model, cfg.kv_heads * cfg.head_dim, shape.attention_bias
    shapes = norm_shapes(cfg, "attn_norm", d) + linear_shapes("attn.wq", d, cfg.q_dim, bias) + \
        linear_shapes("attn.wk", d, kv_dim, bias) + linear_shapes("attn.wv", d, kv_dim, bias) + \
        linear_shapes("attn.wo", cfg.q_dim, d, bias)
    if not shape.one_norm:
        shapes += norm_shapes(cfg, "mlp_norm", d)
    return shapes + linear_shapes("mlp.w_in", d, cfg.d_ff, shape.mlp_bias) + \
        linear_shapes("mlp.w_out", cfg.d_ff, d, shape.mlp_bias)


def rotary_tables(cfg: ModelConfig, shape: ParallelShape) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (max_seq_len, rotated features), in fp64: the frequencies theta^(-2i/n) of
    transformers' GPT-J (create_sinusoidal_positions) and GPT-NeoX (its default rope init over
    int(head_dim · rotary_pct) features), each repeated for its pair (GPT-J) or its half."""
    n = shape.rotary_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, n, 2, dtype=torch.float64) / n)
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv_freq)
    angles = angles.repeat_interleave(2, dim=-1) if shape.interleaved else torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def check_shape(cfg: ModelConfig, shape: ParallelShape) -> None:
    """What the parallel block cannot compute, refused by the field that asks for it: the shared
    Block's own options, and more rotated features than a head has."""
    asked = {"position": cfg.position != "rope", "mlp": cfg.mlp != "gelu", "n_experts": cfg.moe,
             "qkv_bias": cfg.qkv_bias, "qk_norm": cfg.qk_norm}
    for name, refused in asked.items():
        if refused:
            raise ValueError(f"{name}={getattr(cfg, name)!r}: a {cfg.family} block does not compute it")
    if shape.gelu not in ("none", "tanh"):
        raise ValueError(f"a {cfg.family} block's GELU is 'none' or 'tanh', not {shape.gelu!r}")
    if not 0 <= shape.rotated() <= cfg.head_dim:
        raise ValueError(f"{shape.rotated()} rotated features of a {cfg.head_dim}-wide head")


def described(shape_of, check) -> dict:
    """The fields of an OwnBlock (families/base.py) for a family whose block is this one, its
    ParallelShape read from a config by shape_of; check: the family's check of its options."""
    def make(cfg: ModelConfig, router_losses=None, layer: int = 0) -> nn.Module:
        return ParallelBlock(cfg, shape_of(cfg))

    def checked(cfg: ModelConfig) -> None:
        check(cfg)
        check_shape(cfg, shape_of(cfg))
    return dict(make=make, parameter_shapes=lambda cfg, layer: parameter_shapes(cfg, shape_of(cfg)), check=checked,
                rope_tables=lambda cfg: rotary_tables(cfg, shape_of(cfg)))
