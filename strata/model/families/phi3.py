"""Phi-3 (Microsoft: Phi-3 mini, Phi-3.5 mini): Llama's layers under two fused projections, the
queries, keys and values in one `qkv_proj` (rows: q, then k, then v: transformers' Phi3Attention)
and the gate and up matrices in one `gate_up_proj` (rows: gate, then up: Phi3MLP's chunk), an
untied head, and a sliding window (2,047 in the 4k-context models) masking as Mistral's.

The fused tensors are split into strata's q, k, v and gate, up on the way in and joined on the way
out, so each is placed under tensor parallelism as Llama's are. The 128k-context models' "longrope"
RoPE and a partial rotary factor are refused in one line (rope_from_hf)."""

from __future__ import annotations

import torch

from strata.model.config import ModelConfig
from strata.model.families.base import Family, check_choice
from strata.model.families.llama import TENSOR_PARALLEL, shape_from_hf, shape_to_hf, tensors_from_hf, tensors_to_hf

NAME = "phi3"
QKV, GATE_UP = "self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"
SPLIT = {QKV: ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
         GATE_UP: ("mlp.gate_proj.weight", "mlp.up_proj.weight")}


def config_from_hf(hf: dict, where: str) -> ModelConfig:
    check_choice(hf, where, "hidden_act", ("silu",), "silu")
    return ModelConfig(**shape_from_hf(hf, where), sliding_window=hf.get("sliding_window"), family=NAME)


def config_to_hf(cfg: ModelConfig, original: dict) -> dict:
    hf = shape_to_hf(cfg, original, "phi3", "Phi3ForCausalLM")
    return {**hf, "hidden_act": "silu", "sliding_window": cfg.sliding_window}


def _rows(cfg: ModelConfig, fused: str) -> list[int]:
    kv_dim = cfg.kv_heads * cfg.head_dim
    return [cfg.q_dim, kv_dim, kv_dim] if fused == QKV else [cfg.d_ff, cfg.d_ff]


def phi3_tensors_from_hf(hf_tensors: dict, cfg: ModelConfig, where: str) -> dict:
    unfused = {}
    for key, value in hf_tensors.items():
        fused = next((f for f in SPLIT if key.endswith("." + f)), None)
        if fused is None:
            unfused[key] = value
            continue
        layer = key[: -len(fused)]
        for name, part in zip(SPLIT[fused], torch.split(value, _rows(cfg, fused))):
            unfused[layer + name] = part.contiguous()
    return tensors_from_hf(unfused, cfg, where, label="Phi-3")


def phi3_tensors_to_hf(tensors: dict, cfg: ModelConfig, keys: list | None) -> dict:
    out = tensors_to_hf(tensors, cfg, keys)
    for fused, parts in SPLIT.items():
        for key in [k for k in out if k.endswith("." + parts[0])]:
            layer = key[: -len(parts[0])]
            out[layer + fused] = torch.cat([out.pop(layer + part) for part in parts])
    return out


FAMILY = Family(NAME, ("phi3",), TENSOR_PARALLEL, config_from_hf, config_to_hf, phi3_tensors_from_hf,
                phi3_tensors_to_hf)
