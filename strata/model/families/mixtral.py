"""Mixtral (Mistral AI, Jiang et al. 2024; transformers' model_type "mixtral"): Llama's attention
and names, every block's MLP a mixture of SwiGLU experts (strata/model/moe.py) with a top-k
softmax router whose k probabilities are renormalised (num_experts_per_tok, default 2), and
Mistral's optional sliding window (null in the released models: off).

The file keeps each expert's matrices apart, under the names transformers 5 still writes and reads
(its modules fuse them in memory, gate_up_proj, and convert on save and load):
model.layers.N.block_sparse_moe.gate (the router), ...experts.J.w1 (gate), w3 (up) and w2 (down).
strata stacks them into one (n_experts, ...) tensor per projection on the way in and splits them
on the way out, bit for bit; the MoE helpers here serve Qwen2-MoE too.

Tensor parallelism splits each expert as Megatron splits an MLP (w_gate and w_up by output
features, w_down by input features); the router is whole on every rank; expert parallelism
(strata/parallel/expert.py) splits the experts themselves."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial

import torch

from strata.errors import ConfigError
from strata.model.config import ModelConfig
from strata.model.families.base import Family, OwnBlock, check_choice, check_option, in_blocks, read_options, refuse_set
from strata.model.families.llama import BLOCKS, LAYER, shape_from_hf, shape_to_hf, tensors_from_hf, tensors_to_hf
from strata.model.families.llama import TENSOR_PARALLEL as LLAMA_TENSOR_PARALLEL
from strata.model.layers import Block

NAME = "mixtral"
DEFAULT_THETA = 1000000.0  # transformers' MixtralConfig.default_theta, when config.json gives none
# the MoE layer's modules in a block: the router and shared gate whole, the experts' stacked matrices
# split along their d_ff dimension, the shared expert as a dense MLP
# (Llama's MLP placements kept: a family whose layers alternate has dense ones too)
MOE_TENSOR_PARALLEL = {**LLAMA_TENSOR_PARALLEL,
                       **in_blocks({"mlp": "moe", "mlp.router": "replicated", "mlp.shared_gate": "replicated",
                                    "mlp.experts": "stacked_experts", "mlp.shared.w_gate": "column",
                                    "mlp.shared.w_up": "column", "mlp.shared.w_down": "row"})}
ATTENTION_LAYER = {k: v for k, v in LAYER.items() if not k.startswith("mlp.")}  # Llama's names, less the MLP's
DENSE_MLP_LAYER = {k: v for k, v in LAYER.items() if k.startswith("mlp.")}  # a sparse family's dense layers


@dataclass(frozen=True)
class ExpertNames:
    """Where a family's file keeps block N's experts: expert J's projection P is
    f"{BLOCKS}N.{path}.J.{P}.weight"; `projections` maps P to strata's stacked matrix in mlp.experts."""
    path: str
    projections: dict[str, str]

    def pattern(self) -> re.Pattern:
        # an expert index as written (no leading zeros: "07" would alias expert 7)
        return re.compile(rf"{re.escape(BLOCKS)}(\d+)\.{re.escape(self.path)}\.(0|[1-9]\d*)\.(\w+)\.weight")


MIXTRAL_EXPERTS = ExpertNames("block_sparse_moe.experts", {"w1": "w_gate", "w3": "w_up", "w2": "w_down"})
# the stacked tensors go through llama's renaming as f"{BLOCKS}N.{path}.{w_gate|w_up|w_down}"
MIXTRAL_LAYER = {**ATTENTION_LAYER, "block_sparse_moe.gate": "mlp.router", MIXTRAL_EXPERTS.path: "mlp.experts"}


# --- config.json ----------------------------------------------------------------------------------
def experts_from_hf(hf: dict, where: str, count_key: str, defaults: tuple[int, int]) -> dict:
    """The router's fields (defaults: transformers' number of experts and k for the family)."""
    n_experts = hf.get(count_key, defaults[0])
    if not isinstance(n_experts, int) or isinstance(n_experts, bool) or n_experts < 1:
        raise ConfigError(f"{where}: config.json: {count_key}={n_experts!r} must be a whole number >= 1")
    return dict(n_experts=n_experts, experts_per_token=hf.get("num_experts_per_tok", defaults[1]),
                router_aux_coef=hf.get("router_aux_loss_coef", 0.001))


def experts_to_hf(cfg: ModelConfig, count_key: str) -> dict:
    return {count_key: cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
            "router_aux_loss_coef": cfg.router_aux_coef}


def config_from_hf(hf: dict, where: str) -> ModelConfig:
    refuse_set(hf, where, "router_jitter_noise")  # multiplies the router's inputs by noise in training
    check_choice(hf, where, "hidden_act", ("silu",), "silu")
    return ModelConfig(**shape_from_hf({"rope_theta": DEFAULT_THETA, **hf}, where),
                       **experts_from_hf(hf, where, "num_local_experts", (8, 2)),
                       sliding_window=hf.get("sliding_window"), norm_topk=True, family=NAME)


def config_to_hf(cfg: ModelConfig, original: dict) -> dict:
    hf = shape_to_hf(cfg, original, "mixtral", "MixtralForCausalLM")
    return {**hf, **experts_to_hf(cfg, "num_local_experts"), "hidden_act": "silu", "sliding_window": cfg.sliding_window}


# --- tensors --------------------------------------------------------------------------------------
def stack_experts(hf_tensors: dict, cfg: ModelConfig, where: str, names: ExpertNames) -> dict:
    """The file's per-expert matrices as one (n_experts, ...) tensor per block and projection,
    under f"{BLOCKS}N.{path}.{strata's name}"; every other tensor as it is."""
    out, found = {}, {}
    pattern = names.pattern()
    for key, value in hf_tensors.items():
        match = pattern.fullmatch(key)
        if match is None or match[3] not in names.projections:
            out[key] = value
            continue
        if int(match[2]) >= cfg.n_experts:
            raise ConfigError(f"{where}: unexpected tensor {key!r}: the config has {cfg.n_experts} experts")
        found.setdefault((match[1], match[3]), {})[int(match[2])] = value
    for (block, projection), experts in found.items():
        expert_key = f"{BLOCKS}{block}.{names.path}.{{}}.{projection}.weight"
        out[f"{BLOCKS}{block}.{names.path}.{names.projections[projection]}"] = _stacked(experts, cfg, where, expert_key)
    return out


def _stacked(experts: dict[int, torch.Tensor], cfg: ModelConfig, where: str, expert_key: str) -> torch.Tensor:
    missing = [j for j in range(cfg.n_experts) if j not in experts]
    if missing:
        raise ConfigError(f"{where}: no tensor {expert_key.format(missing[0])!r} (the config has {cfg.n_experts} experts)")
    shapes = [list(experts[j].shape) for j in range(cfg.n_experts)]
    if any(shape != shapes[0] for shape in shapes):
        j = next(j for j, shape in enumerate(shapes) if shape != shapes[0])
        raise ConfigError(f"{where}: {expert_key.format(j)} has shape {shapes[j]}, expert 0's {shapes[0]}")
    return torch.stack([experts[j] for j in range(cfg.n_experts)])


def split_experts(hf_tensors: dict, names: ExpertNames) -> dict:
    """The inverse of stack_experts: each stacked tensor as its experts' matrices (copies:
    safetensors refuses names sharing one storage)."""
    file_name = {strata: projection for projection, strata in names.projections.items()}
    out = {}
    for key, value in hf_tensors.items():
        module, _, leaf = key.rpartition(".")
        if not (module.endswith("." + names.path) and leaf in file_name):
            out[key] = value
            continue
        for j, matrix in enumerate(value.unbind(0)):
            out[f"{module}.{j}.{file_name[leaf]}.weight"] = matrix.clone()
    return out


def moe_tensors_from_hf(hf_tensors: dict, cfg: ModelConfig, where: str, layer: dict, names: ExpertNames,
                        label: str) -> dict:
    return tensors_from_hf(stack_experts(hf_tensors, cfg, where, names), cfg, where, layer, label)


def moe_tensors_to_hf(tensors: dict, cfg: ModelConfig, keys: list | None, layer: dict, names: ExpertNames) -> dict:
    return split_experts(tensors_to_hf(tensors, cfg, keys, layer), names)


def moe_style(name: str, model_types: tuple[str, ...], config_from_hf, config_to_hf, layer: dict,
              names: ExpertNames, label: str, tensor_parallel: dict = MOE_TENSOR_PARALLEL,
              block: OwnBlock | None = None) -> Family:
    """A family stored under Llama's names with its experts' matrices apart (`names`)."""
    return Family(name, model_types, tensor_parallel, config_from_hf, config_to_hf,
                  partial(moe_tensors_from_hf, layer=layer, names=names, label=label),
                  partial(moe_tensors_to_hf, layer=layer, names=names), block=block)


# --- mixtures in some layers only ------------------------------------------------------------------
@dataclass(frozen=True)
class SparseLayers:
    """Qwen2-MoE's and Qwen3-MoE's decoder_sparse_step and mlp_only_layers, as transformers reads
    them: layer i has the mixture when (i + 1) % sparse_step == 0 and i is not in dense_layers
    (comma-separated); the others a dense MLP of d_ff (intermediate_size)."""
    sparse_step: int
    dense_layers: str


def _sparse(cfg: ModelConfig) -> tuple[int, set[int]]:
    o = read_options(cfg, SparseLayers)
    try:
        dense = {int(i) for i in o.dense_layers.split(",") if i.strip()} if isinstance(o.dense_layers, str) else None
    except ValueError:
        dense = None
    if dense is None or any(not 0 <= i < cfg.n_layers for i in dense):
        raise ValueError(f"family_options: dense_layers={o.dense_layers!r} must list layers 0..{cfg.n_layers - 1}")
    return o.sparse_step, dense


def _check_sparse(cfg: ModelConfig) -> None:
    check_option("sparse_step", read_options(cfg, SparseLayers).sparse_step, int, lambda n: n >= 1)
    _sparse(cfg)


def sparse_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    step, dense = _sparse(cfg)
    return layer not in dense and (layer + 1) % step == 0


# the shared Block, its MLP the mixture in some layers: only models whose config.json says so carry the
# options; the others (a mixture in every layer) are the shared Block's, as before this block existed
SPARSE_LAYERS = OwnBlock(make=lambda cfg, router_losses=None, layer=0: Block(cfg, router_losses, cfg.layer_is_moe(layer)),
                         parameter_shapes=lambda cfg, layer: cfg.shared_block_shapes(cfg.layer_is_moe(layer)),
                         check=_check_sparse, moe_layer=sparse_moe_layer, optional=True)


def sparse_layers_from_hf(hf: dict, where: str) -> dict:
    """ModelConfig's family_options for a config.json's decoder_sparse_step and mlp_only_layers
    (none when every layer has the mixture)."""
    step, dense, layers = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or [], hf["num_hidden_layers"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ConfigError(f"{where}: config.json: decoder_sparse_step={step!r} must be a whole number >= 1")
    if not isinstance(dense, list) or any(not isinstance(i, int) or not 0 <= i < layers for i in dense):
        raise ConfigError(f"{where}: config.json: mlp_only_layers={dense!r} must list layers 0..{layers - 1}")
    if step == 1 and not dense:
        return {}
    return {"sparse_step": step, "dense_layers": ",".join(str(i) for i in sorted(set(dense)))}


def sparse_layers_to_hf(cfg: ModelConfig) -> dict:
    if not cfg.family_options:
        return {"decoder_sparse_step": 1, "mlp_only_layers": []}
    step, dense = _sparse(cfg)
    return {"decoder_sparse_step": step, "mlp_only_layers": sorted(dense)}


FAMILY = moe_style(NAME, ("mixtral",), config_from_hf, config_to_hf, MIXTRAL_LAYER, MIXTRAL_EXPERTS, "Mixtral")
