"""The shape of a decoder-only transformer, and what follows from it: parameter count, FLOPs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Literal


@dataclass(frozen=True)
class ModelConfig:
    """One dataclass covers the LLaMA family (rmsnorm, rope, swiglu, untied head, GQA) and the
    GPT-2/GPT-3/BLOOM family (layernorm, learned or ALiBi positions, gelu, tied embeddings, biases)."""

    vocab_size: int
    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    max_seq_len: int
    n_kv_heads: int | None = None  # None: as many as n_heads (plain multi-head attention)
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    position: Literal["rope", "learned", "alibi"] = "rope"
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    tie_embeddings: bool = False
    bias: bool = False  # biases on every linear layer (GPT-2, BLOOM)
    embedding_norm: bool = False  # a norm right after the token embedding (BLOOM)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def with_overrides(self, **changes) -> "ModelConfig":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field."""
        for name in ("vocab_size", "n_layers", "d_model", "n_heads", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a whole number >= 1")
        if self.n_kv_heads is not None and (not isinstance(self.n_kv_heads, int) or self.n_kv_heads < 1):
            raise ValueError(f"n_kv_heads={self.n_kv_heads!r} must be a whole number >= 1")
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
                raise ValueError(f"{name}={value!r} must be a positive number")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.kv_heads}")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"rope needs an even head_dim, got {self.head_dim}")

    # --- counting -----------------------------------------------------------------------------
    def num_params(self) -> int:
        """Exact parameter count, computed from the shapes (the same as summing model.parameters())."""
        d, f, b = self.d_model, self.d_ff, int(self.bias)
        kv_dim = self.kv_heads * self.head_dim
        norm = d * (2 if self.norm == "layernorm" else 1)
        attn = d * d + 2 * d * kv_dim + d * d + b * (d + 2 * kv_dim + d)
        if self.mlp == "swiglu":
            mlp = 3 * d * f + b * (2 * f + d)
        else:
            mlp = 2 * d * f + b * (f + d)
        block = 2 * norm + attn + mlp
        embed = self.vocab_size * d
        pos = self.max_seq_len * d if self.position == "learned" else 0
        head = 0 if self.tie_embeddings else self.vocab_size * d + b * self.vocab_size
        return embed + pos + self.n_layers * block + norm + head + (norm if self.embedding_norm else 0)

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token: 6N for the weights (forward 2N, backward 4N) plus 12·L·h·s for
        the attention scores and values (PaLM, Chowdhery et al. 2022, App. B)."""
        s = seq_len or self.max_seq_len
        return 6 * self.num_params() + 12 * self.n_layers * self.d_model * s
