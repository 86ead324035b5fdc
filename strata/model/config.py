"""The shape of a decoder-only transformer, and what follows from it: parameter count, FLOPs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Literal

ROPE_TYPES = ("default", "llama3")
# the fields of Llama 3.1's RoPE scaling (rope_type "llama3"); None under the default RoPE
LLAMA3_ROPE_FIELDS = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len")


@dataclass(frozen=True)
class ModelConfig:
    """One dataclass covers the LLaMA family (rmsnorm, rope, swiglu, untied head, GQA) and its
    descendants (Llama 3.1's RoPE scaling, Qwen2's q/k/v biases, Qwen3's per-head q/k norms,
    Mistral's sliding window, Gemma's (1 + w) norms, scaled embeddings, GeGLU and wide heads), and
    the GPT-2/GPT-3/BLOOM family (layernorm, learned or ALiBi positions, gelu, tied embeddings,
    biases). Every option defaults to what the model was before it existed. `family` names the
    description in strata/model/families that converts it to and from Hugging Face."""

    vocab_size: int
    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    max_seq_len: int
    n_kv_heads: int | None = None  # None: as many as n_heads (plain multi-head attention)
    norm: Literal["rmsnorm", "layernorm", "gemma_rmsnorm"] = "rmsnorm"  # gemma_rmsnorm scales by (1 + w)
    position: Literal["rope", "learned", "alibi"] = "rope"
    mlp: Literal["swiglu", "gelu", "geglu"] = "swiglu"  # geglu: SwiGLU's gate with the tanh GELU (Gemma)
    tie_embeddings: bool = False
    bias: bool = False  # biases on every linear layer (GPT-2, BLOOM)
    embedding_norm: bool = False  # a norm right after the token embedding (BLOOM)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    family: str = ""  # "" : inferred from the other fields (a manifest written before families)
    d_head: int | None = None  # None: d_model // n_heads (Gemma 7B: 3072 wide, 16 heads of 256)
    qkv_bias: bool = False  # biases on q, k and v only (Qwen2)
    qk_norm: bool = False  # an RMSNorm over each head's q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # each token attends to the last W positions, itself included (Mistral)
    scale_embeddings: bool = False  # token embeddings times sqrt(d_model) (Gemma)
    rope_type: str = "default"  # "llama3": Llama 3.1's frequency scaling, with the four fields below
    rope_factor: float | None = None
    rope_low_freq_factor: float | None = None
    rope_high_freq_factor: float | None = None
    rope_original_max_seq_len: int | None = None

    def __post_init__(self):
        if not self.family:
            object.__setattr__(self, "family", infer_family(self))

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_head or self.d_model // self.n_heads

    @property
    def q_dim(self) -> int:
        """The width of the queries (and of the attention output): heads x head_dim."""
        return self.n_heads * self.head_dim

    @property
    def gated_mlp(self) -> bool:
        return self.mlp in ("swiglu", "geglu")

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
            _check_count(name, getattr(self, name))
        for name in ("n_kv_heads", "d_head", "sliding_window"):
            if getattr(self, name) is not None:
                _check_count(name, getattr(self, name))
        for name in ("norm_eps", "rope_theta"):
            _check_positive(name, getattr(self, name))
        for name, valid in (("norm", ("rmsnorm", "layernorm", "gemma_rmsnorm")), ("position", ("rope", "learned", "alibi")),
                            ("mlp", ("swiglu", "gelu", "geglu")), ("rope_type", ROPE_TYPES)):
            if getattr(self, name) not in valid:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {', '.join(valid)}")
        if not isinstance(self.family, str) or not self.family.isidentifier():
            raise ValueError(f"family={self.family!r} must be a name such as 'llama'")
        if self.d_head is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads} (set d_head)")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.kv_heads}")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"rope needs an even head_dim, got {self.head_dim}")
        self._validate_rope_scaling()

    def _validate_rope_scaling(self) -> None:
        scaling = {name: getattr(self, name) for name in LLAMA3_ROPE_FIELDS}
        if self.rope_type == "default":
            given = [name for name, value in scaling.items() if value is not None]
            if given:
                raise ValueError(f"{given[0]}={scaling[given[0]]!r} needs rope_type='llama3'")
            return
        if self.position != "rope":
            raise ValueError(f"rope_type={self.rope_type!r} needs position='rope'")
        for name, value in scaling.items():
            if value is None:
                raise ValueError(f"rope_type='llama3' needs {name}")
            (_check_count if name == "rope_original_max_seq_len" else _check_positive)(name, value)
        if self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError(f"rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
                             f"rope_low_freq_factor={self.rope_low_freq_factor}")

    # --- counting -----------------------------------------------------------------------------
    def norm_params(self, width: int) -> int:
        """A norm over `width` features: a weight, and a bias for LayerNorm."""
        return width * (2 if self.norm == "layernorm" else 1)

    def block_matmul_params(self) -> int:
        """The weights one token multiplies in a block: q, k, v, o and the MLP's matrices."""
        d, kv_dim = self.d_model, self.kv_heads * self.head_dim
        attn = 2 * d * self.q_dim + 2 * d * kv_dim
        return attn + (3 if self.gated_mlp else 2) * d * self.d_ff

    def num_params(self) -> int:
        """Exact parameter count, computed from the shapes (the same as summing model.parameters(),
        and as transformers' num_parameters() of the same model)."""
        inputs, block, outputs = self.unit_params()
        return inputs + self.n_layers * block + outputs

    def unit_params(self) -> tuple[int, int, int]:
        """Parameters of the model's units (Transformer.units: what the pipeline cuts between and
        ZeRO-3 gathers): (the input layers, one block, the output layers; a tied head counts in
        the inputs)."""
        d, f, b = self.d_model, self.d_ff, int(self.bias)
        q_dim, kv_dim = self.q_dim, self.kv_heads * self.head_dim
        norm = self.norm_params(d)
        attn_bias = b * (q_dim + 2 * kv_dim + d) + (0 if b else int(self.qkv_bias) * (q_dim + 2 * kv_dim))
        qk_norms = 2 * self.norm_params(self.head_dim) if self.qk_norm else 0
        mlp_bias = b * ((2 if self.gated_mlp else 1) * f + d)
        block = 2 * norm + self.block_matmul_params() + attn_bias + qk_norms + mlp_bias
        inputs = self.vocab_size * d + (self.max_seq_len * d if self.position == "learned" else 0) + \
            (norm if self.embedding_norm else 0)
        outputs = norm + (0 if self.tie_embeddings else self.vocab_size * d + b * self.vocab_size)
        return inputs, block, outputs

    def attended_positions(self, seq_len: int) -> int:
        """How many keys a query is counted against: the sequence, or the sliding window."""
        return min(seq_len, self.sliding_window) if self.sliding_window else seq_len

    def matmul_params(self) -> int:
        """The weights a token multiplies: every block's q, k, v, o and MLP matrices, and the head
        (the embedding matrix again when tied). Not the input embedding nor learned positions,
        which are looked up, nor norms and biases, which are not multiplied."""
        return self.n_layers * self.block_matmul_params() + self.d_model * self.vocab_size

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training model FLOPs per token: 6 per multiplied weight (forward 2, backward 4) plus
        12·L·h·s for the attention scores and values (PaLM, Chowdhery et al. 2022, App. B), with h
        the width of the queries (heads x head_dim) and s at most the sliding window. The same
        matmuls the planner times (strata/rules/pipeline_cut.unit_costs), so MFU never counts work
        that takes no time (an embedding lookup would add 6·V·h per token)."""
        s = self.attended_positions(seq_len or self.max_seq_len)
        return 6 * self.matmul_params() + 12 * self.n_layers * self.q_dim * s


def infer_family(cfg: ModelConfig) -> str:
    """The family a config's options describe: what a manifest written before `family` existed
    holds (those knew llama, gpt2 and bloom shapes; gptj is the planning-only GPT-J preset)."""
    if cfg.position == "alibi" or cfg.embedding_norm:
        return "bloom"
    if cfg.position == "learned":
        return "gpt2"
    if cfg.norm == "layernorm":
        return "gptj"
    if cfg.norm == "gemma_rmsnorm":
        return "gemma"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias:
        return "qwen2"
    if cfg.sliding_window:
        return "mistral"
    return "llama"


def _check_count(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a whole number >= 1")


def _check_positive(name: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
        raise ValueError(f"{name}={value!r} must be a positive number")
