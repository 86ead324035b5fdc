"""The serving side of the planner (`strata plan --inference`): the memory a model needs to
generate (weights + KV cache) and the time of one decode step, for each tensor × pipeline layout
on the given devices. Every term is in docs/cost-model.md ("Inference").

Decoding a token for a batch of b sequences reads every weight once, plus the KV cache so far, and
does only 2 FLOPs per weight and sequence: at small b it is bound by memory bandwidth, not by
compute (the roofline takes the larger of the two). What it costs beyond that is the serving
stack's fixed cost (Overheads: a constant per layer and step, plus one per step; a profile per
stack, or what `strata calibrate --inference` measures on the user's own device) and, with
tensor parallelism, two all-reduces of b × d activations per layer. Pipeline stages run one after
another for one token; with the batch split into p micro-batches in flight every stage is busy,
which raises tokens/s but not the latency of a token."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from strata.errors import ConfigError
from strata.model.config import ModelConfig
from strata.plan.cost import log_interpolate
from strata.plan.hardware import Device
from strata.plan.inputs import CPU_LOCAL
from strata.plan.stages import stage_loads
from strata.rules.constants import DEFAULT_EFFICIENCY
from strata.rules.dtypes import DTYPES
from strata.rules.layout import check_tensor_parallel

# bytes per weight and per cached value: the run dtypes, and int8 (weights quantized for serving)
BYTES = {**{name: DTYPES[name].bytes for name in ("fp32", "bf16", "fp16")}, "int8": 1}


@dataclass(frozen=True)
class Serving:
    model: ModelConfig
    batch: int = 1  # sequences decoded together
    context: int = 0  # tokens in each sequence so far (prompt + answer): the KV cache read per step
    precision: str = "fp16"  # of weights, activations and the KV cache


@dataclass(frozen=True)
class Overheads:
    """A serving stack's fixed cost of one decode step: the work that does not scale with the bytes
    the step reads or the FLOPs it does. per_layer_s: each layer, each step (an eager stack's
    Python, dispatch and kernel launches; a CUDA graph's gaps between kernels). per_step_s: once a
    step (embedding, head, sampling, the host loop, reading the tokens back). per_layer_on_host:
    the per-layer cost is the host's, issued ahead of an accelerator's stream, so it shows only
    where it exceeds the device's own time; on a CPU (cpu-local) the same cores do both and it adds."""
    per_layer_s: float = 220e-6
    per_step_s: float = 150e-6
    source: str = "strata eager (estimate, uncalibrated)"
    per_layer_on_host: bool = True

    @property
    def per_token_s(self) -> float:
        """The name of the once-per-step cost in calibration profiles and --per-token-us (a step
        gives one token to each sequence)."""
        return self.per_step_s


# Per serving stack, uncalibrated (docs/cost-model.md, "Inference"; `--per-layer-us`/
# `--per-token-us` or `strata calibrate --inference` replace them with the device's own numbers).
STACKS = {
    # strata's own loop, eager: 44 dispatched ops per layer and 15 per step (counted with
    # torch.profiler on a decode step of `small`) at about 5 us each, the host's Python and
    # dispatch as this repository's CPU machine measured them (220 us per layer, 134 per step, on
    # narrow models where the arithmetic is negligible). An estimate for a GPU host, whose launch of
    # a kernel takes the place of the CPU's arithmetic on a tiny tensor.
    "strata": Overheads(),
    # transformers 5.x `generate`, eager: 55 ops per layer and 45 per step (counted as above);
    # 299 us per layer and 437 per step measured beside strata's on the same CPU and narrow models
    # (its generation loop: logits processors, stopping criteria, cache objects).
    "hf-transformers": Overheads(300e-6, 450e-6, "hf-transformers eager (estimate from this repository's CPU)"),
    # A CUDA-graph stack (vLLM, TensorRT-LLM, torch.compile's reduce-overhead): one launch a step;
    # each layer's ~9 fused kernels leave about 1 us of gap each on the device's own timeline (so
    # it adds); per step the scheduler, sampling and output processing. Both are estimates.
    "vllm": Overheads(10e-6, 300e-6, "vllm / CUDA graphs (estimate)", per_layer_on_host=False),
}


def stack_overheads(stack: str = "strata", calibrated: dict | None = None) -> Overheads:
    """The fixed cost of `stack`: its profile, or for strata's own loop what `strata calibrate
    --inference` measured on the device at hand (`calibrated`: the profile's "inference" part)."""
    if stack not in STACKS:
        raise ConfigError(f"--serving-stack {stack}: valid: {', '.join(STACKS)}")
    if calibrated is None or stack != "strata":
        return STACKS[stack]
    return Overheads(calibrated["per_layer_s"], calibrated["per_token_s"], f"calibrated on {calibrated['device']}",
                     calibrated.get("per_layer_on_host", calibrated["device"] != "cpu"))


@dataclass
class ServingEstimate:
    tp: int
    pp: int
    fits: bool
    weight_bytes: float  # per device, on the stage that holds the most
    kv_cache_bytes: float  # per device on that stage, for the whole batch at `context` tokens
    memory_s: float  # the bytes read per token over the memory bandwidth, summed over stages
    compute_s: float  # the FLOPs per token over the effective FLOP/s, summed over stages
    overhead_s: float  # the stack's fixed cost on the token's path: ms/token less the roofline and communication
    tp_comm_s: float
    pp_comm_s: float
    token_latency_s: float  # one decode step of the batch (time per output token)
    tokens_per_s: float  # output tokens per second, the batch together (pp: micro-batches in flight)
    fixed_s: float  # the stack's whole fixed cost per step, per layer and per step, hidden behind the device or not

    @property
    def fixed_share(self) -> float:
        """The share of a token's time that is the stack's fixed cost, not bytes, FLOPs or links."""
        if math.isinf(self.token_latency_s):  # a bound or a cost beyond any float: whichever is infinite
            return 1.0 if math.isinf(self.overhead_s) else 0.0
        return self.overhead_s / self.token_latency_s

    @property
    def bound_s(self) -> float:
        """What the token would take at the roofline and the links alone (no fixed cost)."""
        return self.token_latency_s - self.overhead_s

    @property
    def devices(self) -> int:
        return self.tp * self.pp

    @property
    def memory_bytes(self) -> float:
        return self.weight_bytes + self.kv_cache_bytes

    def describe(self) -> str:
        return f"tp={self.tp},pp={self.pp}"

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "devices": self.devices, "memory_bytes": self.memory_bytes,
                "fixed_share": self.fixed_share, "bound_s": self.bound_s}


def kv_cache_bytes(cfg: ModelConfig, batch: int, context: int, precision: str, tp: int = 1, layers: int | None = None) -> float:
    """Keys and values: 2 x layers x batch x context x kv_heads x head_dim x bytes. Tensor
    parallelism splits the KV heads (and keeps one each when there are fewer heads than ranks).
    Latent attention caches its latent instead: layers x batch x context x latent width x bytes,
    whole on every rank (every rank's heads read all of it)."""
    layers = cfg.n_layers if layers is None else layers
    latent = latent_cache_width(cfg)
    if latent:
        return layers * batch * context * latent * BYTES[precision]
    kv_heads = max(cfg.kv_heads / tp, 1)
    return 2 * layers * batch * context * kv_heads * cfg.head_dim * BYTES[precision]


def latent_cache_width(cfg: ModelConfig) -> int | None:
    """What multi-head latent attention (strata/model/latent_attention.py: DeepSeek-V2/V3) caches per
    token and layer as DeepSeek's inference does (its "absorb" mode): the key/value latent and the
    rotary key every head shares, kv_lora_rank + qk_rope_head_dim numbers, in place of 2 x heads x
    head_dim; None for other attention. Read from the family's options (no torch here)."""
    options = dict(cfg.family_options)
    return options["kv_lora_rank"] + options["qk_rope_head_dim"] if "kv_lora_rank" in options else None


def attention_flops(cfg: ModelConfig, context: int) -> float:
    """The FLOPs one new token's attention does per layer over `context` cached tokens (all heads):
    scores and weighted sum, 2 x 2 x context x d_model; latent attention with its up-projections
    folded into the query and output (DeepSeek's absorb mode) attends every head over the cached
    latent: 2 x context x heads x (kv_lora_rank + qk_rope_head_dim) for the scores and
    2 x context x heads x kv_lora_rank for the weighted sum."""
    latent = latent_cache_width(cfg)
    if latent:
        kv_lora_rank = dict(cfg.family_options)["kv_lora_rank"]
        return 2 * context * cfg.n_heads * (latent + kv_lora_rank)
    return 4 * context * cfg.d_model


def estimate_serving(work: Serving, device: Device, tp: int, pp: int, link_bandwidth: float,
                     link_latency: float, overheads: Overheads, efficiency: float = DEFAULT_EFFICIENCY,
                     read_bandwidth: tuple[tuple[float, float], ...] = ()) -> ServingEstimate:
    """read_bandwidth: (batch, bytes/s) measured by `strata calibrate --inference` (the rate a
    linear layer streams its weight at for that many tokens); without it, the datasheet's."""
    cfg, b, nbytes = work.model, work.batch, BYTES[work.precision]
    micro = b / min(pp, b)  # the batch split into up to pp micro-batches in flight
    bandwidth = log_interpolate(read_bandwidth, micro) if read_bandwidth else device.memory_bandwidth
    peak = device.peak_flops.get(work.precision, device.peak_flops.get("fp16", max(device.peak_flops.values())))
    flops_rate = peak * efficiency
    # The embedding table is only looked up (b rows), unless it is also the head.
    lookup = cfg.vocab_size * cfg.d_model + (cfg.max_seq_len * cfg.d_model if cfg.position == "learned" else 0)
    memory, memory_s, compute_s, layers_s, tp_comm_s = [], 0.0, 0.0, 0.0, 0.0
    for load in stage_loads(cfg, pp, 1, max(work.context, 1)):  # strata's own pipeline cut
        kv = kv_cache_bytes(cfg, b, work.context, work.precision, tp, load.layers)
        memory.append((load.params * nbytes / tp, kv))
        read = load.params - (lookup if load.first and not (load.last and cfg.tie_embeddings) else 0)
        memory_s += (read * nbytes / tp + kv * micro / b) / bandwidth  # a micro-batch's share of the cache
        compute_s += (2 * read / tp + load.layers * attention_flops(cfg, work.context) / tp) * micro / flops_rate
        layers_s += load.layers * overheads.per_layer_s
        if tp > 1:  # two all-reduces of micro x d activations per layer
            tp_comm_s += load.layers * 2 * small_all_reduce_s(micro * cfg.d_model * nbytes, tp, link_bandwidth,
                                                              link_latency)
    pp_comm_s = (pp - 1) * (link_latency + micro * cfg.d_model * nbytes / link_bandwidth)
    # The roofline, over the stages a token passes one after another: the larger of reading the
    # bytes and doing the FLOPs. With m micro-batches in flight, each stage reads its weights once
    # per micro-batch, so a round of the whole batch takes as long as one token's latency.
    bound = max(memory_s, compute_s) + tp_comm_s + pp_comm_s
    fixed_on_path = exposed_fixed_cost(bound, layers_s, overheads, device)
    latency = bound + fixed_on_path
    weights, kv = max(memory, key=sum)
    return ServingEstimate(tp, pp, weights + kv <= device.memory_bytes, weights, kv, memory_s, compute_s,
                           fixed_on_path, tp_comm_s, pp_comm_s, latency, b / latency, layers_s + overheads.per_step_s)


def exposed_fixed_cost(bound_s: float, layers_s: float, overheads: Overheads, device: Device) -> float:
    """What the stack's fixed cost (layers_s: per layer over every layer the token passes, plus
    once per step) adds to the device's own time (bound_s: roofline and links). An eager
    stack on an accelerator issues a layer's kernels ahead of the stream, so its per-layer cost
    hides behind the device's time and shows only where it is longer (the step is host-bound);
    the step's own cost (sampling, reading the tokens back) waits for the device and adds. On a
    CPU, and for a CUDA graph's gaps between kernels, nothing overlaps: it all adds."""
    if overheads.per_layer_on_host and device.name != CPU_LOCAL:
        return max(layers_s - bound_s, 0.0) + overheads.per_step_s
    return layers_s + overheads.per_step_s


def small_all_reduce_s(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """An all-reduce of a few kilobytes: latency-bound, so collective libraries use tree or
    recursive-doubling algorithms, 2 log2(n) steps (not the ring's 2(n - 1)); the bytes still
    cross the link 2(n - 1)/n times."""
    return 2 * math.ceil(math.log2(ranks)) * latency + 2 * (ranks - 1) / ranks * nbytes / bandwidth


def serving_layouts(work: Serving, device: Device, devices: int, link_bandwidth: float, link_latency: float,
                    overheads: Overheads, efficiency: float = DEFAULT_EFFICIENCY,
                    read_bandwidth: tuple[tuple[float, float], ...] = ()) -> list[ServingEstimate]:
    """Every tp x pp on up to `devices` devices that generation runs (the training rules for tp; one
    block at least per stage), those that fit first, then by the latency of a token."""
    cfg = work.model
    out = []
    for tp in _powers_of_two(devices):
        if not _splits(cfg, tp):
            continue
        for pp in _powers_of_two(devices // tp):
            if pp > cfg.n_layers:
                continue
            out.append(estimate_serving(work, device, tp, pp, link_bandwidth, link_latency, overheads, efficiency,
                                        read_bandwidth))
    return sorted(out, key=lambda e: (not e.fits, e.token_latency_s, e.devices))


def _splits(cfg: ModelConfig, tp: int) -> bool:
    try:
        check_tensor_parallel(cfg, tp)
    except ConfigError:
        return False
    return True


def _powers_of_two(limit: int) -> list[int]:
    return [2**k for k in range(int(math.log2(limit)) + 1)] if limit >= 1 else []
