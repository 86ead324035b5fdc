"""Memory per device: model states (Rajbhandari et al., ZeRO, 2020) and activations (Korthikanti
et al., "Reducing Activation Recomputation in Large Transformer Models", 2022, Table 2)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from strata.model.config import ModelConfig
from strata.plan.hardware import Device
from strata.rules.compression import compressible, powersgd_elements
from strata.rules.constants import LOGITS_CHUNK_BYTES
from strata.rules.layout import Layout
from strata.rules.optimizers import OPTIMIZERS, bytes_per_parameter
from strata.rules.optimizers import STATE_BYTES as MOMENT_ELEMENT_BYTES

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


# Optimizer states per parameter, the shared table's (strata/rules/optimizers.py): Adam keeps two fp32
# moments, SGD with momentum and Lion one; Adafactor's depend on the shapes (moment_bytes).
MOMENT_BYTES = {name: MOMENT_ELEMENT_BYTES * o.whole_moments for name, o in OPTIMIZERS.items() if not o.factored}


def moment_bytes(optimizer: str | float) -> float:
    """Bytes of optimizer state per parameter: a name whose states do not depend on the shapes, or
    a number already worked out for a model (`optimizer_bytes_per_param`)."""
    if isinstance(optimizer, str):
        if optimizer not in MOMENT_BYTES:
            raise ValueError(f"optimizer {optimizer!r}: its states depend on the shapes; give "
                             f"optimizer_bytes_per_param(name, model)")
        return MOMENT_BYTES[optimizer]
    return optimizer


def optimizer_rate(optimizer: str, model: ModelConfig) -> str | float:
    """What model_state_bytes takes for this optimizer and model: its name, or where its states
    depend on the shapes (Adafactor) its bytes per parameter of this model."""
    return optimizer if optimizer in MOMENT_BYTES else optimizer_bytes_per_param(optimizer, model)


def optimizer_bytes_per_param(optimizer: str, model: ModelConfig) -> float:
    """The optimizer's state bytes per parameter of this model (Adafactor's from its matrices'
    shapes, the others' a constant)."""
    return bytes_per_parameter(optimizer, parameter_shapes(model))


def parameter_shapes(cfg: ModelConfig) -> list[tuple[int, ...]]:
    """The shape of every parameter of strata's model of this config (strata/model/: the embedding,
    learned positions, each block's norms, projections and MLP or experts, the final norm and the
    head), from the config alone. Their sizes add up to cfg.num_params()."""
    d = cfg.d_model

    def norm(width: int) -> list[tuple[int, ...]]:
        return [(width,)] * (2 if cfg.norm == "layernorm" else 1)

    def linear(k: int, n: int, bias: bool) -> list[tuple[int, ...]]:
        return [(n, k)] + ([(n,)] if bias else [])

    blocks = [shape for layer in range(cfg.n_layers) for _, shape in cfg.block_parameter_shapes(layer)]  # a family's own too
    inputs = [(cfg.vocab_size, d)] + ([(cfg.max_seq_len, d)] if cfg.position == "learned" else []) + \
        (norm(d) if cfg.embedding_norm else [])
    outputs = norm(d) + ([] if cfg.tie_embeddings else linear(d, cfg.vocab_size, cfg.bias))
    return inputs + blocks + outputs


@lru_cache(maxsize=256)
def powersgd_fractions(cfg: ModelConfig, rank: int) -> tuple[float, float, float]:
    """PowerSGD's two rounds per element of the model's gradients, and the share of the elements
    in the matrices it compresses (rules/compression.py), over the model's own parameter shapes;
    under a pipeline the planner applies them to a stage's parameters (each stage compresses its
    own: a stage's blocks share the model's shapes, its embedding or head shifts the shares a little)."""
    shapes = parameter_shapes(cfg)
    total = sum(math.prod(shape) for shape in shapes)
    first, second = powersgd_elements(shapes, rank)
    factored = sum(math.prod(shape) for shape in shapes if compressible(shape, rank))
    return first / total, second / total, factored / total


def onebit_error_bytes(params: float, dp: int) -> float:
    """1-bit Adam's two fp32 error buffers on a rank (parallel/onebit_adam.py): the worker's, of the
    whole model, and the server's, of its chunk (1/dp); the padding to 8 dp elements left out."""
    return 4 * params * (1 + 1 / dp)


def model_state_bytes(params: float, zero: int = 0, dp: int = 1, precision: str = "mixed",
                      optimizer: str | float = "adamw") -> ModelStates:
    """Bytes per device of the model states under ZeRO stage `zero` over `dp` ranks:
    ZeRO-1 shards the optimizer states, ZeRO-2 the gradients too, ZeRO-3 the weights too.
    optimizer: a name, or its state bytes per parameter (moment_bytes)."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero stage {zero}: valid 0, 1, 2, 3")
    w, g, o = (b * params for b in STATE_BYTES[precision])
    o -= (MOMENT_BYTES["adamw"] - moment_bytes(optimizer)) * params
    return ModelStates(w / dp if zero >= 3 else w, g / dp if zero >= 2 else g, o / dp if zero >= 1 else o)


def held_state_bytes(params: float, zero: int = 0, dp: int = 1, precision: str = "mixed",
                     optimizer: str | float = "adamw", gather_dtype: str = "fp32") -> ModelStates:
    """Bytes per device of the model states strata holds (what its metrics count). In fp32 the
    paper's split. In mixed precision strata keeps no 16-bit copy by default: the fp32 masters are
    the weights the layers read (autocast casts them), the gradients are fp32, so ZeRO-0/1/2 hold
    4Ψ + 4Ψ + 8Ψ/N-style splits (16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N) where the paper has 2Ψ + 2Ψ + 12Ψ/N.
    With bf16 gathers ZeRO-1/2 keep DeepSpeed's bf16 weights (2Ψ) beside this rank's fp32 master
    shard (4Ψ/N), and ZeRO-1 a bf16 gradient buffer (2Ψ) beside the reduced fp32 shard (4Ψ/N).
    weights: parameters and masters; grads: gradient buffers and shards; optimizer: the moments."""
    if precision == "fp32":
        return model_state_bytes(params, zero, dp, "fp32", optimizer)
    moments = moment_bytes(optimizer) * params / (dp if zero >= 1 else 1)
    sharded = 4 * params / dp
    if gather_dtype == "bf16" and zero in (1, 2):
        return ModelStates(2 * params + sharded, (2 * params if zero == 1 else 0) + sharded, moments)
    return ModelStates(sharded if zero >= 3 else 4 * params, sharded if zero >= 2 else 4 * params, moments)


def pipelined_zero_bytes(zero: int, pp: int, reshard_after_forward: bool, params: float, gather_dtype: str,
                         reduce_dtype: str) -> float:
    """What ZeRO-2/3 hold under a pipeline besides their shards, through the schedule, for a stage's
    `params` (parallel/gradients.py, parallel/zero3_hooks.py): ZeRO-2 the stage's gradient whole,
    accumulated by autograd in the weights' dtype (the gather dtype's bf16 copies, else the masters');
    ZeRO-3 with reshard_after_forward off the stage's gathered parameters (gather dtype) and their
    gradients staged whole (reduce dtype, else the masters'). Nothing else (ZeRO-3's per-unit
    buffers are priced apart)."""
    if pp == 1 or zero < 2 or (zero == 3 and reshard_after_forward):
        return 0.0
    weights = 2 if gather_dtype == "bf16" else 4  # else the fp32 masters
    if zero == 2:
        return params * weights
    return params * (weights + (2 if reduce_dtype == "bf16" else 4))


def hpz_bytes(lay: Layout, params: float) -> float:
    """ZeRO++'s hpZ (--hpz-partition-size K; parallel/zero3_units.py): each rank's 1/K of every unit
    its forward freed, in the gather dtype, held from the forward to the backward's gather: Ψ/K."""
    if lay.zero != 3 or lay.hpz_partition_size == 1:
        return 0.0
    return params / lay.hpz_partition_size * (2 if lay.gather_dtype == "bf16" else 4)


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


FP32 = 4


def loss_logits_bytes(rows: int, positions: int, width: float, chunk_bytes: int | None = LOGITS_CHUNK_BYTES) -> float:
    """The fp32 logits the loss holds at once on one rank, for `rows` sequences of `positions`
    tokens and `width` logits each (this rank's columns of the vocabulary). Chunked (strata's
    loss, strata/model/loss.chunk_bounds): one chunk of as many positions as fit in `chunk_bytes`
    (at least one), or all of them when they fit in one chunk; None: the whole logits, as a loss
    that keeps them for backward does (Megatron-LM's vocabulary-parallel cross-entropy keeps its
    fp32 softmax: Korthikanti et al. 2022, §4.3, 4sbv/t)."""
    if chunk_bytes is None:
        return FP32 * rows * positions * width
    per_chunk = max(1, chunk_bytes // int(FP32 * rows * width))
    return FP32 * rows * min(per_chunk, positions) * width


def head_activation_bytes(tokens: int, hidden: float, element_bytes: int) -> float:
    """What the last stage keeps for backward between its last block and the loss, beside the
    logits: the final norm's input and its output (the head's input), each tokens x hidden (hidden
    cut t ways where the hidden states are: sequence parallelism, the grids). Korthikanti et al.
    2022, §4.3: 2sbh/t + 2sbh/t in 16 bits."""
    return 2 * tokens * hidden * element_bytes


def head_bytes(cfg: ModelConfig, lay: Layout, seq_len: int, element_bytes: int, chunk_bytes: int | None) -> float:
    """What the last stage keeps between its last block and the loss for one micro-batch on one
    rank: the final norm's input and output (head_activation_bytes) and the fp32 logits the loss
    holds at once (strata's one chunk, or all of them: loss_logits_bytes). The logits are not
    counted in 16 bits as well: the head's 16-bit output is freed once the loss has its fp32 copy."""
    split = lay.tp if (lay.sequence_parallel or lay.tp_mode != "1d") else 1
    tokens = lay.micro_batch * seq_len // lay.cp
    width = math.ceil(cfg.vocab_size / lay.tp)  # this rank's columns of the padded vocabulary
    return head_activation_bytes(tokens, cfg.d_model / split, element_bytes) + \
        loss_logits_bytes(lay.micro_batch, seq_len // lay.cp, width, chunk_bytes)


def device_overhead(device: Device, lay: Layout, tensor_bytes: float) -> dict[str, float]:
    """What a device's memory holds beside the layout's tensors (hardware.py's figures): the CUDA
    context, NCCL's buffers for each process group of more than one rank this rank joins (tensor,
    data (with context) parallel, pipeline, context, expert; hybrid sharding's shard and replica
    groups, hpZ's node group besides), and the caching allocator's reserve
    as a fraction of the tensors. Nothing on cpu-local (its figures are 0)."""
    groups = sum(size > 1 for size in (lay.tp, lay.replicas, lay.pp, lay.cp, lay.ep)) + 2 * (lay.shards < lay.replicas) \
        + (lay.hpz_partition_size > 1)
    overhead = {"cuda_context": device.context_bytes, "nccl_buffers": groups * device.group_bytes,
                "allocator_reserve": device.allocator_reserve * tensor_bytes}
    return {kind: nbytes for kind, nbytes in overhead.items() if nbytes}


def overhead_note(tensor_bytes: float, overhead: dict[str, float], device: Device) -> list[str]:
    """Why a layout whose tensors fit does not, once the device's own use is counted."""
    total = tensor_bytes + sum(overhead.values())
    if not overhead or tensor_bytes > device.memory_bytes or total <= device.memory_bytes:
        return []
    parts = " + ".join(f"{nbytes / 1e9:.1f} GB {kind.replace('_', ' ')}" for kind, nbytes in overhead.items())
    return [f"does not fit: {tensor_bytes / 1e9:.1f} GB of tensors + {parts} = {total / 1e9:.1f} GB, "
            f"over the device's {device.memory_bytes / 1e9:.0f} GB"]


def inference_weight_bytes(params: float, bytes_per_param: int = 2) -> float:
    """Weights alone, for 16-bit inference (KV cache and workspace come on top)."""
    return params * bytes_per_param


def largest_model(device_bytes: float, bytes_per_param: float) -> float:
    """The most parameters whose per-parameter bytes fit in `device_bytes` (states alone)."""
    return device_bytes / bytes_per_param
