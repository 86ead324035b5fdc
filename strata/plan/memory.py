"""Memory per device: model states (Rajbhandari et al., ZeRO, 2020) and activations (Korthikanti
et al., "Reducing Activation Recomputation in Large Transformer Models", 2022, Table 2)."""

from __future__ import annotations

from dataclasses import dataclass

# Bytes per parameter of (weights, gradients, optimizer states) for Adam.
# Mixed precision: 16-bit weights and gradients, fp32 master weights, momentum and variance.
STATE_BYTES = {"mixed": (2, 2, 12), "fp32": (4, 4, 8)}


@dataclass(frozen=True)
class ModelStates:
    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


# Optimizer states per parameter: Adam keeps two fp32 moments, SGD with momentum one.
MOMENT_BYTES = {"adamw": 8, "sgd": 4}


def model_state_bytes(params: float, zero: int = 0, dp: int = 1, precision: str = "mixed",
                      optimizer: str = "adamw") -> ModelStates:
    """Bytes per device of the model states under ZeRO stage `zero` over `dp` ranks:
    ZeRO-1 shards the optimizer states, ZeRO-2 the gradients too, ZeRO-3 the weights too."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero stage {zero}: valid 0, 1, 2, 3")
    w, g, o = (b * params for b in STATE_BYTES[precision])
    o -= (MOMENT_BYTES["adamw"] - MOMENT_BYTES[optimizer]) * params
    return ModelStates(w / dp if zero >= 3 else w, g / dp if zero >= 2 else g, o / dp if zero >= 1 else o)


def held_state_bytes(params: float, zero: int = 0, dp: int = 1, precision: str = "mixed", optimizer: str = "adamw",
                     gather_dtype: str = "fp32") -> ModelStates:
    """Bytes per device of the model states strata holds (what its metrics count). In fp32 the
    paper's split. In mixed precision strata keeps no 16-bit copy by default: the fp32 masters are
    the weights the layers read (autocast casts them), the gradients are fp32, so ZeRO-0/1/2 hold
    4Ψ + 4Ψ + 8Ψ/N-style splits (16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N) where the paper has 2Ψ + 2Ψ + 12Ψ/N.
    With bf16 gathers ZeRO-1/2 keep DeepSpeed's bf16 weights (2Ψ) beside this rank's fp32 master
    shard (4Ψ/N), and ZeRO-1 a bf16 gradient buffer (2Ψ) beside the reduced fp32 shard (4Ψ/N).
    weights: parameters and masters; grads: gradient buffers and shards; optimizer: the moments."""
    if precision == "fp32":
        return model_state_bytes(params, zero, dp, "fp32", optimizer)
    moments = MOMENT_BYTES[optimizer] * params / (dp if zero >= 1 else 1)
    sharded = 4 * params / dp
    if gather_dtype == "bf16" and zero in (1, 2):
        return ModelStates(2 * params + sharded, (2 * params if zero == 1 else 0) + sharded, moments)
    return ModelStates(sharded if zero >= 3 else 4 * params, sharded if zero >= 2 else 4 * params, moments)


def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int, tp: int = 1,
                               sequence_parallel: bool = False, checkpointing: str = "none",
                               fused_attention: bool = False) -> float:
    """16-bit activation bytes one transformer layer keeps for backward, per device (Korthikanti
    et al. 2022, Table 2):
      none, no TP:          sbh(34 + 5as/h)
      tensor parallel:      sbh(10 + 24/t + 5as/(ht))
      + sequence parallel:  sbh(34/t + 5as/(ht))
      selective recompute:  34·sbh/t with sequence parallelism (the attention core is recomputed),
                            sbh(10 + 24/t) without
      full recompute:       2·sbh (the layer input only; /t with sequence parallelism)
    fused_attention: a fused kernel (flash attention, PyTorch's SDPA on CPU and GPU) never stores
    the attention scores, so the 5as/h term is 0 whatever the checkpointing."""
    sbh = seq * batch * hidden
    attention = 5 * heads * seq / (hidden * tp)
    if checkpointing == "full":
        return 2 * sbh / (tp if sequence_parallel else 1)
    if checkpointing not in ("none", "selective"):
        raise ValueError(f"checkpointing {checkpointing!r}: valid none, selective, full")
    if checkpointing == "selective" or fused_attention:
        attention = 0.0
    if sequence_parallel:
        return sbh * (34 / tp + attention)
    if tp == 1:
        return sbh * (34 + attention)
    return sbh * (10 + 24 / tp + attention)


def inference_weight_bytes(params: float, bytes_per_param: int = 2) -> float:
    """Weights alone, for 16-bit inference (KV cache and workspace come on top)."""
    return params * bytes_per_param


def largest_model(device_bytes: float, bytes_per_param: float) -> float:
    """The most parameters whose per-parameter bytes fit in `device_bytes` (states alone)."""
    return device_bytes / bytes_per_param
