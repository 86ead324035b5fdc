"""Published runs added for issue 54: H100 runs with Megatron-Core layouts, data parallelism at
96-288 replicas, FSDP on RoCE, MegaScale's Megatron-LM baselines on up to 12,288 GPUs, MT-NLG. They
were added as runs the defaults had never seen; they are now rows of the one validation table
(strata/plan/validation_table.py), whose hash rule puts each in the fit or the held-out half. Each
row as its source publishes it, priced with its framework's profile (strata/plan/frameworks.py);
docs/cost-model.md ("Validation") gives each source and the rules that fill what a source leaves out:

- micro-batch 1 where not stated; sequence parallelism with tensor parallelism in Megatron-Core's
  runs (its recommended setting) and none in Megatron-LM's and Megatron-DeepSpeed's;
- Megatron-Core's distributed optimizer as ZeRO-1 (it shards the optimizer states over dp), and every
  ZeRO-1 row (Megatron's distributed optimizer, DeepSpeed's ZeRO-1) gathering the updated 16-bit
  parameters, not fp32 ones (gather_dtype bf16);
- activation recomputation as stated, none where a Megatron-Core table does not say;
- an unstated network: 8 x 400 Gb/s InfiniBand per H100 node (a DGX H100's), 8 x 200 Gb/s per
  A100 node (a DGX A100's).

The figures are converted to tokens/s per GPU by each source's own formula (the `published` text
names it)."""

from __future__ import annotations

from strata.model.config import ModelConfig
from strata.plan.published import PublishedRun, _gpt, _mpt
from strata.rules.layout import Layout

_H100_NET = ("ib-400", 8)
_A100_NET = ("ib-200", 8)  # also RoCE at 8 x 200 Gb/s (llm-foundry's 1600 Gbps, MegaScale's 8 x 200G)


def _megatron_core_flops_per_token(model: ModelConfig, seq: int) -> float:
    """Megatron-Core's num_floating_point_operations per token (training.py, 2024-07): 12 l h^2 ((1 +
    g/a + s/h) + f/h + V/(2 l h)) x 3 (forward and backward), no recomputation."""
    L, h, V = model.n_layers, model.d_model, model.vocab_size
    g_over_a = (model.n_kv_heads or model.n_heads) / model.n_heads
    return 3 * 2 * L * h * h * ((1 + g_over_a + seq / h) + model.d_ff / h + V / (2 * L * h)) * 2


def _core_weak_scaling(params: str, layers: int, hidden: int, heads: int, t: int, p: int, gpus: int, batch: int,
                       tflops: float, mfu: str) -> PublishedRun:
    model = _gpt(layers, hidden, heads, vocab=131072, seq=4096)
    layout = Layout(dp=gpus // (t * p), tp=t, pp=p, zero=1, micro_batch=1, sequence_parallel=t > 1,
                    reduce_dtype="bf16", gather_dtype="bf16")
    return PublishedRun(f"GPT {params}, {gpus} H100", "Megatron-LM README, H100 weak scaling (2024-07)",
                        "Megatron-Core", model, "H100-80G", gpus, *_H100_NET, layout, batch, 4096, True,
                        f"{tflops:g} TFLOP/s per GPU (MFU {mfu})",
                        tflops * 1e12 / _megatron_core_flops_per_token(model, 4096))


def _nemotron(name: str, layers: int, hidden: int, heads: int, t: int, p: int, gpus: int, batch: int,
              iteration_s: float, mfu: str) -> PublishedRun:
    """Nemotron-4 (squared-ReLU MLP of 4h: priced as GeLU's two matrices, the same FLOPs), 8 KV heads,
    256K vocabulary, 4,096 tokens, untied embeddings, the distributed optimizer."""
    model = ModelConfig(vocab_size=256000, n_layers=layers, d_model=hidden, n_heads=heads, n_kv_heads=8,
                        d_ff=4 * hidden, max_seq_len=4096, mlp="gelu")
    v = 2 if p > 1 else 1  # "interleaved" without a count (340B)
    layout = Layout(dp=gpus // (t * p), tp=t, pp=p, virtual_stages=v, zero=1, micro_batch=1, sequence_parallel=True,
                    schedule="interleaved" if v > 1 else "1f1b", reduce_dtype="bf16", gather_dtype="bf16")
    return PublishedRun(f"Nemotron-4 {name}, {gpus} H100", "NVIDIA 2024, Nemotron-4 technical reports, Table 2",
                        "Megatron-Core", model, "H100-80G", gpus, *_H100_NET, layout, batch, 4096, True,
                        f"{iteration_s:g} s per iteration (MFU {mfu})", batch * 4096 / iteration_s / gpus)


def _foundry_h100(name: str, model: ModelConfig, gpus: int, mbs: int, accumulation: int, recompute: bool,
                  tokens_per_s: float, mfu: str, device: str = "H100-80G") -> PublishedRun:
    h100 = device.startswith("H100")
    # the README's mixed-precision mode: amp_bf16 DEFAULT on H100 (bf16 gathers, fp32 reductions),
    # bf16 PURE on A100-40GB (bf16 gathers and reductions)
    layout = Layout(dp=gpus, zero=3, micro_batch=mbs, checkpointing="full" if recompute else "none",
                    gather_dtype="bf16", reduce_dtype="fp32" if h100 else "bf16")
    net = _H100_NET if h100 else _A100_NET
    return PublishedRun(f"MPT {name}, {gpus} {device}", "llm-foundry, scripts/train/benchmarking/README.md",
                        "llm-foundry (PyTorch FSDP)", model, device, gpus, *net, layout, gpus * mbs * accumulation,
                        2048, True, f"{tokens_per_s:g} tokens/s per GPU (MFU {mfu})", tokens_per_s,
                        fabric="" if h100 else "1600 Gb/s RoCE per node")


def _megascale(gpus: int, batch: int, iteration_s: float, mfu: str) -> PublishedRun:
    """MegaScale's Megatron-LM baseline (Jiang et al. 2024, Table 2): 175B, 96 layers of 12,288, 128
    heads, 64K vocabulary, tp 8, pp 8 with 6 virtual stages, on 8 x 200G RoCE per node."""
    model = _gpt(96, 12288, 128, vocab=64000)
    layout = Layout(dp=gpus // 64, tp=8, pp=8, virtual_stages=6, micro_batch=1, schedule="interleaved",
                    reduce_dtype="bf16", zero=1, gather_dtype="bf16")
    return PublishedRun(f"GPT 175B (MegaScale baseline), {gpus} A100", "Jiang et al. 2024 (MegaScale), Table 2",
                        "Megatron-LM", model, "A100-80G", gpus, *_A100_NET, layout, batch, 2048, True,
                        f"{iteration_s:g} s per iteration (MFU {mfu})", batch * 2048 / iteration_s / gpus,
                        fabric="8 x 200 Gb/s RoCE")


def _mt_nlg(gpus: int, iteration_s: float, tflops: float) -> PublishedRun:
    """MT-NLG 530B (Smith et al. 2022): 105 layers of 20,480, 128 heads, tp 8, pp 35, batch 1,920."""
    layout = Layout(dp=gpus // 280, tp=8, pp=35, zero=1, micro_batch=1, checkpointing="full", reduce_dtype="bf16",
                    gather_dtype="bf16")
    return PublishedRun(f"MT-NLG 530B, {gpus} A100", "Smith et al. 2022 (MT-NLG), section 2.4",
                        "Megatron-DeepSpeed", _gpt(105, 20480, 128), "A100-80G", gpus, *_A100_NET, layout, 1920, 2048,
                        False, f"{iteration_s:g} s per iteration ({tflops:g} TFLOP/s)", 1920 * 2048 / iteration_s / gpus)


UNSEEN_RUNS: tuple[PublishedRun, ...] = (
    _core_weak_scaling("1.7B", 24, 2048, 16, 1, 1, 48, 192, 408.8, "41%"),
    _core_weak_scaling("7.1B", 30, 4096, 32, 2, 1, 96, 192, 465.9, "47%"),
    _core_weak_scaling("16B", 32, 6144, 48, 4, 1, 192, 192, 489.1, "49%"),
    _core_weak_scaling("32B", 48, 7168, 56, 8, 1, 384, 192, 459.6, "46%"),
    _core_weak_scaling("70B", 84, 8192, 64, 8, 2, 768, 384, 419.7, "42%"),
    _core_weak_scaling("119B", 92, 10240, 80, 8, 4, 1536, 768, 420.5, "43%"),
    _core_weak_scaling("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8, "44%"),
    _core_weak_scaling("314B", 96, 16384, 128, 8, 8, 3072, 1536, 474.4, "48%"),
    _core_weak_scaling("462B", 112, 18432, 144, 8, 16, 6144, 3072, 459.9, "47%"),
    _nemotron("15B", 32, 6144, 48, 8, 1, 768, 384, 0.57, "34.3%"),
    _nemotron("15B", 32, 6144, 48, 8, 1, 1536, 768, 0.58, "33.3%"),
    _nemotron("15B", 32, 6144, 48, 8, 1, 2304, 1152, 0.64, "30.5%"),
    _nemotron("340B", 96, 18432, 96, 8, 12, 1536, 768, 10.3, "42.4%"),
    _nemotron("340B", 96, 18432, 96, 8, 12, 3072, 1536, 10.3, "42.3%"),
    _nemotron("340B", 96, 18432, 96, 8, 12, 6144, 2304, 8.0, "41.0%"),
    _foundry_h100("70B", _mpt(8192, 80, 64), 64, 8, 4, True, 1039, "42.57%"),
    _foundry_h100("30B", _mpt(7168, 48, 56), 32, 14, 3, True, 2308, "43.92%"),
    _foundry_h100("13B", _mpt(5120, 40, 40), 64, 2, 1, False, 4800, "39.86%"),
    _foundry_h100("7B", _mpt(4096, 32, 32), 8, 6, 1, False, 10643, "46.44%"),
    _foundry_h100("70B", _mpt(8192, 80, 64), 128, 4, 1, True, 376, "48.91%", "A100-40G"),
    _foundry_h100("30B", _mpt(7168, 48, 56), 128, 6, 1, True, 865, "52.25%", "A100-40G"),
    _foundry_h100("13B", _mpt(5120, 40, 40), 128, 16, 1, True, 1972, "51.93%", "A100-40G"),
    _foundry_h100("7B", _mpt(4096, 32, 32), 128, 18, 1, True, 3623, "50.14%", "A100-40G"),
    _megascale(256, 768, 40.0, "53.0%"),
    _megascale(6144, 6144, 14.78, "47.8%"),
    _megascale(12288, 6144, 8.57, "41.2%"),
    _mt_nlg(2240, 60.1, 126),
    _mt_nlg(2800, 50.2, 121),
    _mt_nlg(3360, 44.4, 113),
)
