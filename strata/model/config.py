"""The shape of a decoder-only transformer, and what follows from it: parameter count, FLOPs."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache
from typing import Literal, Protocol

# (SHAPE_LIMITS and infer_family are read from here too)
from strata.model.shape_checks import SHAPE_LIMITS, check_count, check_limit, check_positive, infer_family  # noqa: F401

ROPE_TYPES = ("default", "llama3")
# the fields of Llama 3.1's RoPE scaling (rope_type "llama3"); None under the default RoPE
LLAMA3_ROPE_FIELDS = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len")
Shapes = list[tuple[str, tuple[int, ...]]]  # parameters by their path in a block, in the order it registers them


class OwnBlock(Protocol):
    """What ModelConfig reads of a family's own block (strata/model/families/base.OwnBlock)."""

    def parameter_shapes(self, cfg: ModelConfig, layer: int) -> Shapes: ...

    def check(self, cfg: ModelConfig) -> None: ...

    # (ModelConfig, layer index) -> whether that layer's MLP is the mixture of experts (DeepSeek's
    # first layers keep a dense one); None: every layer's is, when the config has experts
    moe_layer: Callable[[ModelConfig, int], bool] | None
    # (ModelConfig, layer index) -> the block's persistent buffers (checkpointed state that is no
    # parameter: DeepSeek-V3's expert bias); None: none
    buffer_shapes: Callable[[ModelConfig, int], Shapes] | None
    optional: bool  # without family_options the shared Block computes the family's models

    # ModelConfig -> why context parallelism's ring cannot compute the block's attention, or None (it can)
    context_refusal: Callable[[ModelConfig], str | None] | None
    # (ModelConfig, sequence length) -> what a token's attention multiplies, summed over the layers:
    # heads x (query/key width + value width) x the positions it attends; None: the shared block's
    attention_products: Callable[[ModelConfig, int], int] | None


# The families whose description brings a block of its own (GPT-J, GPT-NeoX: Family.block), by
# name. strata.model.families fills it when it is imported: this module sits below the families
# and imports none of them, yet counts their blocks (the planner reads the counts from here).
OWN_BLOCKS: dict[str, OwnBlock] = {}
# Each family's tensor-parallel placements (families/base.PLACEMENTS), by name, filled alike: the
# rules check a layout against them without importing the families (rules/tensor_modes.check_grid).
FAMILY_PLACEMENTS: dict[str, frozenset[str]] = {}


@dataclass(frozen=True)
class ModelConfig:
    """One dataclass covers the LLaMA family (rmsnorm, rope, swiglu, untied head, GQA) and its
    descendants (Llama 3.1's RoPE scaling, Qwen2's q/k/v biases, Qwen3's per-head q/k norms,
    Mistral's sliding window, Gemma's (1 + w) norms, scaled embeddings, GeGLU and wide heads), and
    the GPT-2/GPT-3/BLOOM family (layernorm, learned or ALiBi positions, gelu, tied embeddings,
    biases). Every option defaults to what the model was before it existed. `family` names the
    description in strata/model/families that converts it to and from Hugging Face.

    These options are the shared Block's, and its list is closed: a family whose computation
    differs (GPT-J's and GPT-NeoX's parallel block) brings its own block, and its own options ride
    in the one generic field `family_options`. Outside the block the shared fields keep their
    meaning (embedding, positions, final norm, head); inside it the family's block decides (for
    such a family `bias` is the head's bias alone, `qkv_bias` and `qk_norm` are refused)."""

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
    # Mixture of experts (Mixtral, Qwen2-MoE): n_experts > 0 replaces every block's MLP by a
    # router over n_experts SwiGLU experts of width expert_d_ff (d_ff when None), each token sent
    # to its experts_per_token best; norm_topk renormalises the k chosen probabilities to sum to 1
    # (Mixtral; Qwen2-MoE does not); shared_d_ff > 0 adds an expert every token goes through
    # (Qwen2-MoE, DeepSeek), scaled by sigmoid(a learned gate) when gated_shared_expert; router_aux_coef
    # weights the load-balancing loss (Switch, Fedus et al. 2021).
    n_experts: int = 0
    experts_per_token: int = 2
    expert_d_ff: int | None = None
    norm_topk: bool = True
    shared_d_ff: int = 0
    gated_shared_expert: bool = False
    router_aux_coef: float = 0.01
    # What a family with its own block computes beyond the fields above (GPT-J's rotary_dim,
    # GPT-NeoX's rotary_pct and parallel residual), as plain (name, value) pairs sorted by name (a
    # dict is accepted): the family reads them into its own options (strata/model/families), the
    # shared Block reads none. Plain data, so that a preset and a manifest can hold them.
    family_options: tuple[tuple[str, bool | int | float | str], ...] = ()

    def __post_init__(self):
        if not self.family:
            object.__setattr__(self, "family", infer_family(self))
        if not isinstance(self.family_options, tuple) or any(not isinstance(p, tuple) for p in self.family_options):
            object.__setattr__(self, "family_options", _sorted_pairs(self.family_options))

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
    def moe(self) -> bool:
        return self.n_experts > 0

    @property
    def expert_width(self) -> int:
        """An expert's hidden width (d_ff unless the model gives experts their own, as Qwen2-MoE)."""
        return self.expert_d_ff or self.d_ff

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
            check_count(name, getattr(self, name))
        for name in ("n_kv_heads", "d_head", "sliding_window"):
            if getattr(self, name) is not None:
                check_count(name, getattr(self, name))
        for name in ("norm_eps", "rope_theta"):
            check_positive(name, getattr(self, name))
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
        self._validate_experts()
        self._validate_family_options()

    def _validate_family_options(self) -> None:
        for name, value in self.family_options:
            if not isinstance(name, str) or not name.isidentifier() or not isinstance(value, (bool, int, float, str)):
                raise ValueError(f"family_options: {name!r}={value!r} must be a name and a number, flag or word")
        if self.family in OWN_BLOCKS and not OWN_BLOCKS[self.family].optional and not self.family_options:
            raise ValueError(f"family {self.family!r} computes a block of its own and needs its family_options "
                             f"(a model of this family written before that block existed computed strata's "
                             f"shared block: it is not this family's model)")
        if self.family_options:
            self.own_block().check(self)

    def _validate_experts(self) -> None:
        if not isinstance(self.n_experts, int) or isinstance(self.n_experts, bool) or self.n_experts < 0:
            raise ValueError(f"n_experts={self.n_experts!r} must be 0 (a dense MLP) or a whole number of experts")
        check_limit("n_experts", self.n_experts)
        if not self.moe:
            return
        check_count("experts_per_token", self.experts_per_token)
        if self.experts_per_token > self.n_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} exceeds n_experts={self.n_experts}")
        if self.expert_d_ff is not None:
            check_count("expert_d_ff", self.expert_d_ff)
        if self.mlp != "swiglu":
            raise ValueError(f"mlp={self.mlp!r}: experts are SwiGLU MLPs (mlp='swiglu')")
        if not isinstance(self.shared_d_ff, int) or self.shared_d_ff < 0:
            raise ValueError(f"shared_d_ff={self.shared_d_ff!r} must be 0 (no shared expert) or a width")
        check_limit("shared_d_ff", self.shared_d_ff)
        if self.gated_shared_expert and not self.shared_d_ff:
            raise ValueError("gated_shared_expert needs a shared expert (shared_d_ff > 0)")
        if not isinstance(self.router_aux_coef, (int, float)) or not 0 <= self.router_aux_coef < float("inf"):
            raise ValueError(f"router_aux_coef={self.router_aux_coef!r} must be a number >= 0")

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
            (check_count if name == "rope_original_max_seq_len" else check_positive)(name, value)
        if self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError(f"rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
                             f"rope_low_freq_factor={self.rope_low_freq_factor}")

    def own_block(self) -> OwnBlock | None:
        """The family's own block, or None: the shared Block computes this model. A config carries
        family_options exactly when its family brings a block of its own."""
        own = OWN_BLOCKS.get(self.family)
        if self.family_options and own is None:
            raise ValueError(f"family_options={dict(self.family_options)!r}: family {self.family!r} has no block "
                             f"of its own (or strata.model.families was never imported)")
        return own if self.family_options else None

    # --- counting -----------------------------------------------------------------------------
    def norm_params(self, width: int) -> int:
        """A norm over `width` features: a weight, and a bias for LayerNorm."""
        return width * (2 if self.norm == "layernorm" else 1)

    @property
    def uniform_layers(self) -> bool:
        """Whether every block has the same parameters (DeepSeek's first dense layers before its
        mixtures do not): where they differ, a count of one block names its layer."""
        return _uniform(self)

    def layer_is_moe(self, layer: int) -> bool:
        """Whether block `layer`'s MLP is the mixture of experts."""
        own = self.own_block()
        return self.moe and (own is None or own.moe_layer is None or own.moe_layer(self, layer))

    def moe_layer_count(self) -> int:
        """The blocks whose MLP is the mixture (each adds its router's auxiliary loss)."""
        return _moe_layer_count(self)

    def _layer(self, layer: int | None) -> int:
        """The block a per-block count describes: `layer`, or any when every block is the same."""
        if layer is None:
            if not self.uniform_layers:
                raise ValueError(f"the blocks of this {self.family} model differ by layer (dense and mixture "
                                 f"MLPs): name the layer")
            return 0
        return layer

    def block_matmul_params(self, layer: int | None = None) -> int:
        """The weights one token multiplies in block `layer` (any when all are the same): q, k, v, o
        and the MLP's matrices (with experts: the router, the experts_per_token experts a token is
        sent to, the shared expert and its gate: the active parameters, not all of them)."""
        layer = self._layer(layer)
        own = self.own_block()
        if own is not None:  # its matrices (norm weights and biases are vectors); of its experts, k
            shapes = own.parameter_shapes(self, layer)
            idle = (self.n_experts - self.experts_per_token) * 3 * self.d_model * self.expert_width \
                if self.layer_is_moe(layer) else 0
            return sum(math.prod(shape) for _, shape in shapes if len(shape) == 2) + \
                sum(math.prod(shape) for _, shape in shapes if len(shape) == 3) - idle
        d, kv_dim = self.d_model, self.kv_heads * self.head_dim
        attn = 2 * d * self.q_dim + 2 * d * kv_dim
        if self.moe:
            return attn + self.router_params() + self.experts_per_token * 3 * d * self.expert_width + \
                self.shared_params()
        return attn + (3 if self.gated_mlp else 2) * d * self.d_ff

    def blocks_matmul_params(self) -> int:
        """What every block's tokens multiply, summed over the blocks (block_matmul_params each)."""
        return _blocks_matmul_params(self)

    def router_params(self) -> int:
        return self.d_model * self.n_experts if self.moe else 0

    def shared_params(self) -> int:
        """The shared expert's matrices and its gate."""
        return 3 * self.d_model * self.shared_d_ff + (self.d_model if self.gated_shared_expert else 0)

    def expert_params(self) -> int:
        """All routed experts' parameters in one block (what expert parallelism splits)."""
        return self.n_experts * 3 * self.d_model * self.expert_width

    def num_params(self) -> int:
        """Exact parameter count, computed from the shapes (the same as summing model.parameters(),
        and as transformers' num_parameters() of the same model)."""
        inputs, _, outputs = self.unit_params()
        return inputs + sum(self.layer_params()) + outputs

    def active_params(self) -> int:
        """The parameters one token uses: all of them, less the experts it is not sent to."""
        idle = self.moe_layer_count() * (self.n_experts - self.experts_per_token) * 3 * self.d_model * self.expert_width
        return self.num_params() - idle

    def buffer_elements(self) -> int:
        """What a checkpoint holds beyond the parameters: the blocks' persistent buffers."""
        own = self.own_block()
        if own is None or own.buffer_shapes is None:
            return 0
        return sum(math.prod(shape) for i in range(self.n_layers) for _, shape in own.buffer_shapes(self, i))

    def layer_params(self) -> tuple[int, ...]:
        """Each block's parameters, by layer."""
        return _layer_params(self)

    def unit_params(self) -> tuple[int, int, int]:
        """Parameters of the model's units (Transformer.units: what the pipeline cuts between and
        ZeRO-3 gathers): (the input layers, the largest block (every block where all are the same),
        the output layers; a tied head counts in the inputs)."""
        d, b = self.d_model, int(self.bias)
        norm = self.norm_params(d)
        inputs = self.vocab_size * d + (self.max_seq_len * d if self.position == "learned" else 0) + \
            (norm if self.embedding_norm else 0)
        outputs = norm + (0 if self.tie_embeddings else self.vocab_size * d + b * self.vocab_size)
        return inputs, max(self.layer_params()), outputs

    def block_parameter_shapes(self, layer: int | None = None) -> Shapes:
        """Each parameter of block `layer` (any when every block is the same), (its path in the
        block, its shape), in the order the block registers them: the shared Block's (with experts:
        all of them), or those its family's own block declares (OwnBlock.parameter_shapes). What
        unit_params counts, and what the planner's parameter lists (plan/memory.py,
        plan/buckets.py) can read instead of listing them again."""
        layer = self._layer(layer)
        own = self.own_block()
        return own.parameter_shapes(self, layer) if own is not None else self.shared_block_shapes(self.moe)

    def shared_block_shapes(self, moe: bool) -> Shapes:
        """The shared Block's parameters, its MLP the mixture or the dense one (a family whose layers
        alternate builds the shared Block either way: families/mixtral.SPARSE_LAYERS)."""
        d, kv_dim, head = self.d_model, self.kv_heads * self.head_dim, self.head_dim
        qkv_bias = self.bias or self.qkv_bias
        shapes = norm_shapes(self, "attn_norm", d) + linear_shapes("attn.wq", d, self.q_dim, qkv_bias) + \
            linear_shapes("attn.wk", d, kv_dim, qkv_bias) + linear_shapes("attn.wv", d, kv_dim, qkv_bias) + \
            linear_shapes("attn.wo", self.q_dim, d, self.bias)
        if self.qk_norm:
            shapes += norm_shapes(self, "attn.q_norm", head) + norm_shapes(self, "attn.k_norm", head)
        return shapes + norm_shapes(self, "mlp_norm", d) + self.mlp_shapes(moe)

    def mlp_shapes(self, moe: bool) -> Shapes:
        """The MLP's parameters: the dense one of width d_ff, or the mixture (router, stacked
        experts, the shared expert and its gate); a family's own block reads them too."""
        d, f, b = self.d_model, self.d_ff, self.bias
        if not moe:
            ins = ("mlp.w_gate", "mlp.w_up") if self.gated_mlp else ("mlp.w_in",)
            outs = linear_shapes("mlp.w_down" if self.gated_mlp else "mlp.w_out", f, d, b)
            return [shape for name in ins for shape in linear_shapes(name, d, f, b)] + outs
        n, e, s = self.n_experts, self.expert_width, self.shared_d_ff  # no biases (Mixtral, Qwen2-MoE)
        shapes = [("mlp.router.weight", (n, d)), ("mlp.experts.w_gate", (n, e, d)), ("mlp.experts.w_up", (n, e, d)),
                  ("mlp.experts.w_down", (n, d, e))]
        if s:
            shapes += linear_shapes("mlp.shared.w_gate", d, s, False) + linear_shapes("mlp.shared.w_up", d, s, False) + \
                linear_shapes("mlp.shared.w_down", s, d, False)
        return shapes + (linear_shapes("mlp.shared_gate", d, 1, False) if self.gated_shared_expert else [])

    def attended_positions(self, seq_len: int) -> int:
        """How many keys a query is counted against: the sequence, or the sliding window."""
        return min(seq_len, self.sliding_window) if self.sliding_window else seq_len

    def matmul_params(self) -> int:
        """The weights a token multiplies: every block's q, k, v, o and MLP matrices, and the head
        (the embedding matrix again when tied). Not the input embedding nor learned positions,
        which are looked up, nor norms and biases, which are not multiplied."""
        return self.blocks_matmul_params() + self.d_model * self.vocab_size

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training model FLOPs per token: 6 per multiplied weight (forward 2, backward 4) plus
        12·L·h·s for the attention scores and values (PaLM, Chowdhery et al. 2022, App. B), with h
        the width of the queries (heads x head_dim) and s at most the sliding window. The same
        matmuls the planner times (strata/rules/pipeline_cut.unit_costs), so MFU never counts work
        that takes no time (an embedding lookup would add 6·V·h per token). A family's own block
        counts its attention itself (`attention_products`: Gemma 2's local layers, MLA's value
        heads narrower than its keys): 6 per product, as 12·h·s is 6 x heads x 2·head_dim x s."""
        return 6 * self.matmul_params() + 6 * self.attention_products(seq_len or self.max_seq_len)

    def attention_products(self, seq_len: int) -> int:
        """What a token's attention multiplies, summed over the layers: heads x (query/key width +
        value width) x the positions it attends (2·h·s a layer for the shared block, s at most the
        window); a family's own block counts its own (Gemma 2's local layers, MLA's narrower values).
        Forward FLOPs are twice this, a training step's six times (with recomputation more)."""
        own = self.own_block()
        if own is not None and own.attention_products is not None:
            return own.attention_products(self, seq_len)
        return self.n_layers * 2 * self.q_dim * self.attended_positions(seq_len)


# The counts by layer, once per config (the planner's search asks them for every layout it prices).
@lru_cache(maxsize=256)
def _uniform(cfg: ModelConfig) -> bool:
    own = cfg.own_block()
    return not cfg.moe or own is None or own.moe_layer is None or \
        len({own.moe_layer(cfg, i) for i in range(cfg.n_layers)}) == 1


@lru_cache(maxsize=256)
def _moe_layer_count(cfg: ModelConfig) -> int:
    return sum(cfg.layer_is_moe(i) for i in range(cfg.n_layers)) if cfg.moe else 0


@lru_cache(maxsize=256)
def _blocks_matmul_params(cfg: ModelConfig) -> int:
    if cfg.uniform_layers:
        return cfg.n_layers * cfg.block_matmul_params()
    return sum(cfg.block_matmul_params(i) for i in range(cfg.n_layers))


@lru_cache(maxsize=256)
def _layer_params(cfg: ModelConfig) -> tuple[int, ...]:
    if cfg.uniform_layers:
        return (sum(math.prod(shape) for _, shape in cfg.block_parameter_shapes()),) * cfg.n_layers
    return tuple(sum(math.prod(shape) for _, shape in cfg.block_parameter_shapes(i)) for i in range(cfg.n_layers))


def linear_shapes(path: str, inputs: int, outputs: int, bias: bool) -> Shapes:
    """A linear layer's weight (outputs, inputs) and, with a bias, its bias."""
    return [(f"{path}.weight", (outputs, inputs))] + ([(f"{path}.bias", (outputs,))] if bias else [])


def norm_shapes(cfg: ModelConfig, path: str, width: int) -> Shapes:
    """The config's norm over `width` features: a weight, and LayerNorm's bias."""
    return [(f"{path}.weight", (width,))] + ([(f"{path}.bias", (width,))] if cfg.norm == "layernorm" else [])


def _sorted_pairs(options) -> tuple:
    """family_options as given (a dict, or pairs: a manifest's JSON lists) -> (name, value) pairs by name."""
    pairs = options.items() if isinstance(options, dict) else options
    return tuple(sorted((name, value) for name, value in pairs))
