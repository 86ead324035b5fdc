"""DeepSeek-V3 and DeepSeek-V2 (DeepSeek-AI 2024; transformers' model_types "deepseek_v3" and
"deepseek_v2"): multi-head latent attention (strata/model/latent_attention.py) in a pre-norm block
with RMSNorm, RoPE on qk_rope_head_dim features of each head in interleaved pairs (V2 always; V3
unless rope_interleave is false), an untied head; the first first_k_dense_replace layers with a
dense SwiGLU MLP, the rest with DeepSeekMoE (strata/model/deepseek_moe.py): n_routed_experts of
moe_intermediate_size, num_experts_per_tok per token, n_shared_experts shared ones (one MLP of
n_shared_experts x moe_intermediate_size, as transformers builds it), routed by V2's softmax
(greedy or group_limited_greedy) or V3's sigmoid with the experts' bias (noaux_tc), over n_group
groups of which topk_group are kept, the weights times routed_scaling_factor (renormalised first
when norm_topk_prob: V3; transformers' V2 never renormalises, so a V2 file asking it is refused).

Refused in one line naming the key: YaRN's rope scaling (V3's released config), biases on the
attention, moe_layer_freq other than 1 (transformers reads none). The MLA and routing options
are the family's own (cfg.family_options, DeepSeekOptions); d_head holds the query/key head
width, qk_nope_head_dim + qk_rope_head_dim. V2's auxiliary loss weight is the file's
aux_loss_alpha (0.001 when absent, DeepSeek-V2-Lite's); V3 balances by its bias instead
(balance_rate 0.001, the report's gamma) and has no auxiliary loss here (its sequence-wise one,
weighted 0.0001, is not built).

Tensors are stored under Llama's names with the attention's own (self_attn.q_a_proj,
q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj; q_proj without a query
latent) and the mixture's (mlp.gate with V3's e_score_correction_bias, a buffer strata keeps
under the same name, mlp.experts.J.*_proj stacked on the way in, mlp.shared_experts.*)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial

from strata.errors import ConfigError
from strata.model.config import ModelConfig, Shapes
from strata.model.deepseek_moe import DeepSeekMoE, Routing, check_routing
from strata.model.families.base import (
    Family,
    OwnBlock,
    check_choice,
    check_option,
    default_rope_theta_from_hf,
    default_rope_to_hf,
    in_blocks,
    read_options,
    refuse_set,
)
from strata.model.families.llama import LAYER as LLAMA_LAYER
from strata.model.families.mixtral import MOE_TENSOR_PARALLEL, moe_tensors_from_hf, moe_tensors_to_hf
from strata.model.families.qwen2_moe import QWEN2_MOE_EXPERTS
from strata.model.latent_attention import LatentShape, described

NAME = "deepseek_v3"
MODEL_TYPES = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}
ATTENTION = {"self_attn.q_proj": "attn.wq", "self_attn.q_a_proj": "attn.wq_a", "self_attn.q_a_layernorm":
             "attn.q_a_norm", "self_attn.q_b_proj": "attn.wq_b", "self_attn.kv_a_proj_with_mqa": "attn.wkv_a",
             "self_attn.kv_a_layernorm": "attn.kv_a_norm", "self_attn.kv_b_proj": "attn.wkv_b",
             "self_attn.o_proj": "attn.wo"}
MIXTURE = {"mlp.gate": "mlp.router", QWEN2_MOE_EXPERTS.path: "mlp.experts", "mlp.shared_experts.gate_proj":
           "mlp.shared.w_gate", "mlp.shared_experts.up_proj": "mlp.shared.w_up",
           "mlp.shared_experts.down_proj": "mlp.shared.w_down"}
LAYER = {**{k: v for k, v in LLAMA_LAYER.items() if not k.startswith("self_attn.")}, **ATTENTION, **MIXTURE}
# Megatron-Core's MLA split (and DeepSeek's inference): the down projections and their norms whole on
# every rank, fed by the norm's one input conversion; they serve only this rank's heads, so their
# gradients are parts, summed over the group ("summed_replica").
# The up projections split by heads, the output projection by its input features.
TENSOR_PARALLEL = {"embed": "vocabulary", "head": "vocabulary", "final_norm": "input_norm",
                   **in_blocks({"attn_norm": "input_norm", "attn.wq_a": "summed_replica",
                                "attn.q_a_norm": "summed_replica", "attn.wq_b": "column", "attn.wq": "column",
                                "attn.wkv_a": "summed_replica", "attn.kv_a_norm": "summed_replica",
                                "attn.wkv_b": "column", "attn.wo": "row",
                                "mlp_norm": "input_norm", "mlp.w_gate": "column", "mlp.w_up": "column",
                                "mlp.w_down": "row"}),
                   # the mixture's layers as every mixture's (the shared experts a dense MLP)
                   **{k: v for k, v in MOE_TENSOR_PARALLEL.items() if k.startswith("blocks.*.mlp")}}


@dataclass(frozen=True)
class DeepSeekOptions:
    q_lora_rank: int  # 0: queries from one projection (q_proj), as DeepSeek-V2-Lite
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    # the mixture's (with n_experts > 0; DENSE's without): its layers from first_dense on, and
    # deepseek_moe.Routing's fields
    first_dense: int
    scoring: str
    groups: int
    groups_kept: int
    routed_scale: float
    balance_rate: float


DENSE = dict(first_dense=0, scoring="softmax", groups=1, groups_kept=1, routed_scale=1.0, balance_rate=0.0)


@lru_cache(maxsize=256)
def options(cfg: ModelConfig) -> DeepSeekOptions:
    return read_options(cfg, DeepSeekOptions)


def block_shape(cfg: ModelConfig) -> LatentShape:
    o = options(cfg)
    return LatentShape(o.q_lora_rank, o.kv_lora_rank, o.qk_nope_head_dim, o.qk_rope_head_dim, o.v_head_dim,
                       o.rope_interleave)


def routing(cfg: ModelConfig) -> Routing:
    o = options(cfg)
    return Routing(o.scoring, o.groups, o.groups_kept, o.routed_scale, o.balance_rate)


def check(cfg: ModelConfig) -> None:
    o = options(cfg)
    check_option("q_lora_rank", o.q_lora_rank, int, lambda n: n >= 0)
    for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        check_option(name, getattr(o, name), int, lambda n: n >= 1)
    check_option("qk_rope_head_dim", o.qk_rope_head_dim, int, lambda n: n >= 2 and n % 2 == 0)
    check_option("rope_interleave", o.rope_interleave, bool)
    check_option("first_dense", o.first_dense, int, lambda n: n >= 0)
    check_option("scoring", o.scoring, str)
    for name in ("groups", "groups_kept"):
        check_option(name, getattr(o, name), int)
    for name in ("routed_scale", "balance_rate"):
        check_option(name, getattr(o, name), float)
    if cfg.moe:
        check_routing(cfg, routing(cfg))
        if cfg.shared_d_ff % cfg.expert_width or cfg.gated_shared_expert:
            raise ValueError(f"shared_d_ff={cfg.shared_d_ff}: DeepSeek's shared experts are n_shared_experts "
                             f"ungated experts of expert_d_ff={cfg.expert_width} each")


def mixture_of(cfg: ModelConfig, router_losses) -> DeepSeekMoE:
    return DeepSeekMoE(cfg, router_losses, routing(cfg))


def moe_layer(cfg: ModelConfig, layer: int) -> bool:
    return layer >= options(cfg).first_dense


def buffer_shapes(cfg: ModelConfig, layer: int) -> Shapes:
    """V3's expert bias, in each layer of experts (deepseek_moe.DeepSeekMoE)."""
    sigmoid = cfg.layer_is_moe(layer) and options(cfg).scoring == "sigmoid"
    return [("mlp.router.e_score_correction_bias", (cfg.n_experts,))] if sigmoid else []


# --- config.json ----------------------------------------------------------------------------------
def config_from_hf(hf: dict, where: str) -> ModelConfig:
    check_choice(hf, where, "hidden_act", ("silu",), "silu")
    check_choice(hf, where, "moe_layer_freq", (1,), 1)  # transformers puts a mixture in every later layer
    refuse_set(hf, where, "attention_bias", "mlp_bias")
    layers, heads, v3 = hf["num_hidden_layers"], hf["num_attention_heads"], hf.get("model_type") != "deepseek_v2"
    if hf.get("num_key_value_heads") not in (None, heads):
        raise ConfigError(f"{where}: config.json: num_key_value_heads={hf['num_key_value_heads']!r} is not supported "
                          f"(latent attention has a key and a value per query head: {heads})")
    if not isinstance(hf["qk_rope_head_dim"], int) or hf["qk_rope_head_dim"] % 2:  # before d_head's own check
        raise ConfigError(f"{where}: config.json: qk_rope_head_dim={hf['qk_rope_head_dim']!r} is not supported "
                          f"(an even number: RoPE turns pairs of features)")
    latent = dict(q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
                  qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                  v_head_dim=hf["v_head_dim"], rope_interleave=not v3 or bool(hf.get("rope_interleave", True)))
    dense = hf.get("first_k_dense_replace", 3 if v3 else 0)  # the classes' defaults
    experts = hf.get("n_routed_experts", hf.get("num_experts", 256 if v3 else 64)) or 0
    mixture = _mixture_from_hf(hf, where, v3, dense) if isinstance(dense, int) and dense < layers and experts else {}
    return ModelConfig(vocab_size=hf["vocab_size"], n_layers=layers, d_model=hf["hidden_size"], n_heads=heads,
                       d_ff=hf["intermediate_size"], max_seq_len=hf["max_position_embeddings"],
                       d_head=latent["qk_nope_head_dim"] + latent["qk_rope_head_dim"],
                       norm_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                       rope_theta=default_rope_theta_from_hf(hf, where), family=NAME,
                       **{k: v for k, v in mixture.items() if k != "options"},
                       family_options={**latent, **mixture.get("options", DENSE)})


def _mixture_from_hf(hf: dict, where: str, v3: bool, dense: int) -> dict:
    """ModelConfig's mixture fields and the routing options, for a file with layers of experts."""
    method = hf.get("topk_method", "noaux_tc" if v3 else "greedy")
    check_choice(hf, where, "topk_method", ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy"), method)
    if not v3:
        refuse_set(hf, where, "norm_topk_prob")  # transformers' DeepseekV2TopkRouter never renormalises
    width, shared = hf.get("moe_intermediate_size", 2048 if v3 else 1407), hf.get("n_shared_experts") or 0
    grouped = v3 or method == "group_limited_greedy"
    groups, kept = (hf.get("n_group") or 1, hf.get("topk_group") or 1) if grouped else (1, 1)
    options = dict(first_dense=dense, scoring="sigmoid" if v3 else "softmax", groups=groups, groups_kept=kept,
                   routed_scale=float(hf.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
                   balance_rate=V3_BALANCE_RATE if v3 else 0.0)
    return dict(n_experts=hf.get("n_routed_experts", hf.get("num_experts")), experts_per_token=hf.get(
        "num_experts_per_tok", 8 if v3 else 6), expert_d_ff=width, shared_d_ff=shared * width,
        norm_topk=v3 and bool(hf.get("norm_topk_prob", True)),
        router_aux_coef=0.0 if v3 else hf.get("aux_loss_alpha", 0.001), options=options)


# the bias's step per training step (DeepSeek-V3 report, section 4.2: gamma 0.001 for most of the run)
V3_BALANCE_RATE = 0.001


def config_to_hf(cfg: ModelConfig, original: dict) -> dict:
    o = options(cfg)
    hf = dict(original)
    by_scoring = "deepseek_v2" if cfg.moe and o.scoring == "softmax" else "deepseek_v3"
    model_type = hf.get("model_type") if hf.get("model_type") in MODEL_TYPES and not cfg.moe else by_scoring
    hf.update(model_type=model_type, architectures=[MODEL_TYPES[model_type]],
              vocab_size=cfg.vocab_size, num_hidden_layers=cfg.n_layers, hidden_size=cfg.d_model,
              num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads, intermediate_size=cfg.d_ff,
              max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
              tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu", attention_bias=False,
              q_lora_rank=o.q_lora_rank or None, kv_lora_rank=o.kv_lora_rank,
              qk_nope_head_dim=o.qk_nope_head_dim, qk_rope_head_dim=o.qk_rope_head_dim, v_head_dim=o.v_head_dim,
              first_k_dense_replace=o.first_dense if cfg.moe else max(hf.get("first_k_dense_replace") or 0, cfg.n_layers))
    if cfg.moe:
        v3 = model_type == "deepseek_v3"
        hf.update(n_routed_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                  moe_intermediate_size=cfg.expert_width, n_shared_experts=cfg.shared_d_ff // cfg.expert_width,
                  n_group=o.groups, topk_group=o.groups_kept, routed_scaling_factor=o.routed_scale,
                  topk_method="noaux_tc" if v3 else "greedy" if o.groups == 1 else "group_limited_greedy")
        if v3:
            hf["norm_topk_prob"] = cfg.norm_topk
        else:
            hf["aux_loss_alpha"] = cfg.router_aux_coef
    if model_type == "deepseek_v3":
        hf["rope_interleave"] = o.rope_interleave  # V2 always interleaves: read back, a V2 file says so
    default_rope_to_hf(hf, cfg, original)
    return hf


FAMILY = Family(NAME, tuple(MODEL_TYPES), TENSOR_PARALLEL, config_from_hf, config_to_hf,
                partial(moe_tensors_from_hf, layer=LAYER, names=QWEN2_MOE_EXPERTS, label="DeepSeek"),
                partial(moe_tensors_to_hf, layer=LAYER, names=QWEN2_MOE_EXPERTS),
                block=OwnBlock(**described(block_shape, check, mixture_of, moe_layer, buffer_shapes)))
