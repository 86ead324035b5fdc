"""Published training runs the planner is checked against (docs/cost-model.md, "Validation"):
each with its source, the model, the cluster and the layout as published, and the throughput the
source reports, converted to tokens per second per device with the source's own FLOP formula.

Where a source leaves a field out, one rule fills it for every row, never tuned per run:
- micro-batch 1 and, where the source says "interleaved" without a count, 2 virtual stages;
- 16-bit gradient reduction for Megatron-LM and Megatron-DeepSpeed (their 2021-2022 default),
  FSDP's defaults (bf16 parameters gathered, fp32 reductions) for the PyTorch FSDP runs;
- Megatron-LM's attention of 2021-2022 unfused (softmax between two batched GEMMs); fused
  (FlashAttention) for the runs of 2023 on;
- Megatron's weight gradients summed into the fp32 accumulator by the GEMM (its gradient
  accumulation fusion) in Megatron-LM; a pass of their own in autograd under DeepSpeed's engine
  (Megatron-DeepSpeed, whose layers are plain F.linear) and PyTorch's (FSDP, torchtitan);
- ZeRO-1 (DeepSpeed's, Megatron's distributed optimizer) gathering the updated 16-bit parameters.

These rows are part of the one validation table (strata/plan/validation_table.py), which splits
it into a fit half and a held-out half by a hash of each row's name."""

from __future__ import annotations

from dataclasses import dataclass, replace

from strata.model.config import ModelConfig
from strata.plan.cost import Estimate, estimate
from strata.plan.frameworks import Framework, framework
from strata.plan.goodput import GoodputSettings
from strata.plan.inputs import build_cluster, workload
from strata.plan.links import Cluster
from strata.plan.run_cost import expected_cost
from strata.plan.workload import Workload, with_framework
from strata.rules.layout import Layout

# each source's code base -> its profile
PROFILES = {"Megatron-LM": "megatron-lm", "Megatron-Core": "megatron-core", "Megatron-DeepSpeed": "megatron-deepspeed",
            "llm-foundry (PyTorch FSDP)": "torchtitan", "torchtitan (FSDP2)": "torchtitan",
            "Meta's Llama 3 stack (PyTorch 4D)": "torchtitan", "strata (the planner's pick)": "strata"}


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    framework: str
    model: ModelConfig
    device: str
    gpus: int
    network: str  # per NIC
    nics_per_node: int
    layout: Layout
    global_batch: int
    seq_len: int
    fused_attention: bool
    published: str  # the figure as the source states it
    tokens_per_s: float  # per device, from that figure
    fabric: str = ""  # the network as the source names it, where the priced link only stands in for it
    # a production total: the device-hours the source gives for `run_tokens` tokens (None: a throughput row)
    device_hours: float | None = None
    run_tokens: float | None = None

    @property
    def profile(self) -> Framework:
        """The framework profile the run is priced with (strata/plan/frameworks.py)."""
        return framework(PROFILES[self.framework])

    def cluster(self) -> Cluster:
        return build_cluster(self.device, max(1, self.gpus // 8), min(8, self.gpus), None, self.network,
                             self.nics_per_node)

    def work(self) -> Workload:
        work = with_framework(workload(self.model, self.global_batch, self.seq_len, "bf16"), self.profile.name)
        # an era's attention: the row's (Megatron-LM's and BLOOM's of 2021-2022 unfused)
        return replace(work, fused_attention=self.fused_attention)

    def predict(self) -> Estimate:
        return estimate(self.work(), self.cluster(), self.layout)

    def predicted_hours(self) -> float:
        """A production total's expected device-hours: the steady state's plus checkpoints,
        evaluation and failures at the planner's defaults (strata/plan/goodput.py)."""
        costs = expected_cost(self.work(), self.predict(), self.run_tokens, min(8, self.gpus), GoodputSettings())
        return costs.expected.device_hours

    def predicted_tokens_per_s(self) -> float:
        """Per device: the step's throughput, or for a production total its tokens over the
        expected device-seconds of the whole run (so a total compares as its throughput does)."""
        if self.device_hours is None:
            return self.predict().tokens_per_s / self.gpus
        return self.run_tokens / (self.predicted_hours() * 3600)

    def error(self) -> float:
        """Predicted over published throughput, minus one (a total: published over predicted
        device-hours, minus one): positive is optimistic."""
        return self.predicted_tokens_per_s() / self.tokens_per_s - 1


def _gpt(layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048) -> ModelConfig:
    """Megatron-LM's GPT: learned positions, LayerNorm, GeLU MLP of 4h, biases, tied embeddings."""
    return ModelConfig(vocab_size=vocab, n_layers=layers, d_model=hidden, n_heads=heads, d_ff=4 * hidden,
                       max_seq_len=seq, norm="layernorm", position="learned", mlp="gelu", tie_embeddings=True,
                       bias=True)


def _megatron_eq3(tflops: float, model: ModelConfig, seq: int) -> float:
    """Tokens/s per GPU from Narayanan et al.'s TFLOP/s, eq. (3): 96·B·s·l·h²(1 + s/6h + V/16lh)
    per iteration of B sequences (recomputation included)."""
    L, h, V = model.n_layers, model.d_model, model.vocab_size
    per_token = 96 * L * h * h * (1 + seq / (6 * h) + V / (16 * L * h))
    return tflops * 1e12 / per_token


_NARAYANAN = "Narayanan et al. 2021, Table 1"
_SELENE = ("ib-200", 8)  # 8 x HDR 200 Gb/s per DGX A100 node


def _narayanan(params: str, heads: int, hidden: int, layers: int, t: int, p: int, gpus: int, batch: int,
               tflops: float) -> PublishedRun:
    model = _gpt(layers, hidden, heads)
    v = 2 if p > 1 and layers % (2 * p) == 0 else 1
    layout = Layout(dp=gpus // (t * p), tp=t, pp=p, virtual_stages=v, micro_batch=1, checkpointing="full",
                    schedule="interleaved" if v > 1 else "1f1b", reduce_dtype="bf16")
    return PublishedRun(f"GPT {params}, {gpus} A100", _NARAYANAN, "Megatron-LM", model, "A100-80G", gpus, *_SELENE,
                        layout, batch, 2048, False, f"{tflops:g} TFLOP/s (eq. 3)", _megatron_eq3(tflops, model, 2048))


def _korthikanti(params: str, heads: int, hidden: int, layers: int, p: int, gpus: int, batch: int, mbs: int,
                 v: int, iteration_s: float, mfu: str) -> PublishedRun:
    layout = Layout(dp=gpus // (8 * p), tp=8, pp=p, virtual_stages=v, micro_batch=mbs, checkpointing="selective",
                    sequence_parallel=True, schedule="interleaved" if v > 1 else "1f1b", reduce_dtype="bf16")
    return PublishedRun(f"GPT {params}, {gpus} A100", "Korthikanti et al. 2022, Tables 3 and 5", "Megatron-LM",
                        _gpt(layers, hidden, heads), "A100-80G", gpus, *_SELENE, layout, batch, 2048, False,
                        f"{iteration_s:g} s per iteration (MFU {mfu})", batch * 2048 / iteration_s / gpus)


def _mpt(hidden: int, layers: int, heads: int) -> ModelConfig:
    """MosaicML's MPT (llm-foundry's benchmark models): ALiBi, LayerNorm, GeLU MLP of 4h, no biases,
    tied embeddings, vocabulary 50368."""
    return ModelConfig(vocab_size=50368, n_layers=layers, d_model=hidden, n_heads=heads, d_ff=4 * hidden,
                       max_seq_len=2048, norm="layernorm", position="alibi", mlp="gelu", tie_embeddings=True)


def _foundry(name: str, model: ModelConfig, gpus: int, mbs: int, accumulation: int, recompute: bool,
             tokens_per_s: float, mfu: str) -> PublishedRun:
    layout = Layout(dp=gpus, zero=3, micro_batch=mbs, checkpointing="full" if recompute else "none",
                    gather_dtype="bf16")
    return PublishedRun(f"MPT {name}, {gpus} A100", "llm-foundry, scripts/train/benchmarking/README.md",
                        "llm-foundry (PyTorch FSDP)", model, "A100-80G", gpus, "ib-200", 8, layout,
                        gpus * mbs * accumulation, 2048, True, f"{tokens_per_s:g} tokens/s per GPU (MFU {mfu})",
                        tokens_per_s, fabric="NVLink only (one node)")


def _llama(layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, seq: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, n_layers=layers, d_model=hidden, n_heads=heads, n_kv_heads=kv, d_ff=ffn,
                       max_seq_len=seq)


def _titan(name: str, model: ModelConfig, gpus: int, mbs: int, seq: int, recompute: str, tokens_per_s: float,
           mfu: str) -> PublishedRun:
    layout = Layout(dp=gpus, zero=3, micro_batch=mbs, checkpointing=recompute, gather_dtype="bf16")
    return PublishedRun(f"{name}, {gpus} A100", "torchtitan, docs/performance.md (April 2024)",
                        "torchtitan (FSDP2)", model, "A100-80G", gpus, "ib-200", 8, layout, gpus * mbs, seq, True,
                        f"{tokens_per_s:g} tokens/s per GPU (MFU {mfu})", tokens_per_s)


BLOOM = ModelConfig(vocab_size=250880, n_layers=70, d_model=14336, n_heads=112, d_ff=4 * 14336, max_seq_len=2048,
                    norm="layernorm", position="alibi", mlp="gelu", tie_embeddings=True, bias=True,
                    embedding_norm=True)

RUNS: tuple[PublishedRun, ...] = (
    _narayanan("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    _narayanan("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    _narayanan("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    _narayanan("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    _narayanan("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    _narayanan("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _narayanan("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _narayanan("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _narayanan("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    _narayanan("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
    _korthikanti("22B", 64, 6144, 48, 1, 8, 4, 4, 1, 1.10, "41.5%"),
    _korthikanti("175B", 96, 12288, 96, 8, 64, 64, 1, 3, 13.75, "51.4%"),
    _korthikanti("530B", 128, 20480, 105, 35, 280, 280, 1, 3, 37.83, "56.0%"),
    _korthikanti("1T", 160, 25600, 128, 64, 512, 512, 1, 1, 71.49, "56.3%"),
    PublishedRun("BLOOM 176B, 384 A100", "BigScience tr11-176B-ml (chronicles, log of 2022-03-18)",
                 "Megatron-DeepSpeed", BLOOM, "A100-80G", 384, "100gbe", 4,
                 Layout(dp=8, tp=4, pp=12, zero=1, micro_batch=2, checkpointing="full", reduce_dtype="bf16",
                        gather_dtype="bf16"),
                 2048, 2048, False, "105.22 s per iteration (149 TFLOP/s)", 2048 * 2048 / 105.22 / 384,
                 fabric="4 x 100 Gb/s Omni-Path"),
    _foundry("1B", _mpt(2048, 24, 16), 8, 14, 4, False, 20513, "59.86%"),
    _foundry("7B", _mpt(4096, 32, 32), 8, 6, 2, False, 4641, "64.23%"),
    _foundry("13B", _mpt(5120, 40, 40), 8, 2, 3, False, 2262, "59.57%"),
    _foundry("30B", _mpt(7168, 48, 56), 8, 3, 21, True, 916, "55.3%"),
    _titan("Llama 3 8B", _llama(32, 4096, 32, 8, 14336, 128256, 8192), 64, 1, 8192, "selective", 2904, "56.8%"),
    _titan("Llama 2 13B", _llama(40, 5120, 40, 40, 13824, 32000, 4096), 64, 2, 4096, "none", 2162, "61.1%"),
    _titan("Llama 3 70B", _llama(80, 8192, 64, 8, 28672, 128256, 8192), 64, 1, 8192, "full", 331, "51.7%"),
    _titan("Llama 2 70B", _llama(80, 8192, 64, 8, 28672, 32000, 4096), 64, 2, 4096, "full", 353, "50.5%"),
)
