"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B; transformers' model_type "qwen2_moe"): Qwen2's
attention (q/k/v biases) with every block's MLP a mixture of SwiGLU experts of
moe_intermediate_size, k per token without renormalising (norm_topk_prob false), plus a shared
expert of shared_expert_intermediate_size scaled by sigmoid(a learned gate)."""

from __future__ import annotations

from strata.model.families.base import Family
from strata.model.families.mixtral import MOE_TENSOR_PARALLEL

NAME = "qwen2_moe"

FAMILY = Family(NAME, (), MOE_TENSOR_PARALLEL)
