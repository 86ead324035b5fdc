"""Mixtral (Mistral AI, Jiang et al. 2024; transformers' model_type "mixtral"): Llama's attention
and names, every block's MLP a mixture of SwiGLU experts (strata/model/moe.py) with a top-k
softmax router whose k probabilities are renormalised (num_experts_per_tok, default 2).

Tensor parallelism splits each expert as Megatron splits an MLP (w_gate and w_up by output
features, w_down by input features); the router is whole on every rank; expert parallelism
(strata/parallel/expert.py) splits the experts themselves."""

from __future__ import annotations

from strata.model.families.base import in_blocks
from strata.model.families.llama import TENSOR_PARALLEL as LLAMA_TENSOR_PARALLEL
from strata.model.families.base import Family

NAME = "mixtral"
# the MoE layer's modules in a block: the router and shared gate whole, the experts' stacked matrices
# split along their d_ff dimension, the shared expert as a dense MLP
MOE_TENSOR_PARALLEL = {**{k: v for k, v in LLAMA_TENSOR_PARALLEL.items() if not k.startswith("blocks.*.mlp.")},
                       **in_blocks({"mlp.router": "replicated", "mlp.shared_gate": "replicated",
                                    "mlp.experts": "experts", "mlp.shared.w_gate": "column",
                                    "mlp.shared.w_up": "column", "mlp.shared.w_down": "row"})}

FAMILY = Family(NAME, (), MOE_TENSOR_PARALLEL)
