"""Framework profiles: what a published run's code base did that changes its speed, as a documented
set of switches (`strata plan --framework`, `PublishedRun.framework`). strata's own runs are
priced as strata runs; a run of another framework with that framework's features.

  fused_attention     attention in one kernel (FlashAttention, cuDNN, SDPA), or scores materialised
                      and softmaxed between two batched GEMMs
  fused_accumulation  weight gradients summed into the fp32 accumulator by the GEMM itself
                      (Megatron's gradient-accumulation fusion), or a pass of their own
  tp_overlap          tensor-parallel collectives overlapped with the GEMMs they feed, chunk by chunk
                      (Megatron-Core's --tp-comm-overlap, Transformer Engine's userbuffers)
  bucket_elements     ZeRO-0/1/2's gradient bucket, in elements, given the data-parallel size
  chunked_loss        the loss computed a chunk of the sequence at a time, so the whole fp32 logits
                      never exist (strata/model/loss.py), or the whole logits kept
  attention_kernel    the fused attention kernel: "flash" (FlashAttention-2, SDPA's flash backend) or
                      "cudnn" (cuDNN's, which Transformer Engine prefers on Hopper and later; on a
                      device without a cuDNN measurement, the flash kernel's rate)
  pipeline_dp_overlap under a pipeline, the gradient buckets reduced as the last micro-batch's backward
                      fills them (Megatron-Core's --overlap-grad-reduce: its hooks fire on the last
                      micro-batch of each model chunk), or all after the schedule (strata's runtime,
                      parallel/gradients.py: exposed)

Sources, per profile, in `source` and docs/cost-model.md ("Framework profiles")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from strata.errors import ConfigError
from strata.rules.constants import BUCKET_MB

_MB_ELEMENTS = BUCKET_MB * 2**20 / 4  # --bucket-mb of fp32 masters, in elements


@dataclass(frozen=True)
class Framework:
    name: str
    fused_attention: bool
    fused_accumulation: bool
    tp_overlap: bool
    bucket_elements: Callable[[int], float]
    source: str
    chunked_loss: bool = False
    pipeline_dp_overlap: bool = False
    attention_kernel: str = "flash"

    def bucket_mb(self, dp: int) -> float:
        """The gradient bucket as --bucket-mb counts it (MB of fp32 master elements)."""
        return self.bucket_elements(dp) * 4 / 2**20


FRAMEWORKS: dict[str, Framework] = {f.name: f for f in (
    Framework("strata", True, False, False, lambda dp: _MB_ELEMENTS,
              "strata's runtime: SDPA's fused attention, autograd's gradient accumulation, no TP overlap, "
              "25 MB buckets (--bucket-mb), the loss in chunks", chunked_loss=True),
    Framework("megatron-lm", False, True, False, lambda dp: _MB_ELEMENTS,
              "Megatron-LM of 2021-2022 (Narayanan et al. 2021, Korthikanti et al. 2022): attention as two "
              "batched GEMMs around a fused softmax, gradient-accumulation fusion, TP collectives exposed; "
              "buckets as strata's (the table's fit)"),
    Framework("megatron-core", True, True, True, lambda dp: max(40_000_000, 1_000_000 * dp),
              "Megatron-Core (r0.8, 2024): Transformer Engine's fused attention (cuDNN's on Hopper: NVIDIA NeMo's "
              "docs, memory_optimizations.rst), gradient-accumulation fusion, "
              "--tp-comm-overlap, --overlap-grad-reduce and --overlap-param-gather (the README's H100 runs), "
              "the gradient buckets reduced during the last micro-batch's backward under a pipeline too, DDP "
              "buckets of max(40M, 1M x dp) parameters (distributed_data_parallel_config.py bucket_size)",
              pipeline_dp_overlap=True, attention_kernel="cudnn"),
    Framework("megatron-deepspeed", False, False, False, lambda dp: 500_000_000,
              "Megatron-DeepSpeed (BLOOM, MT-NLG, 2021-2022): Megatron's unfused attention; no gradient-"
              "accumulation fusion (its ColumnParallelLinear is F.linear, bigscience-workshop/Megatron-DeepSpeed "
              "megatron/mpu/layers.py: DeepSpeed's engine owns the gradients, autograd sums them into .grad, a "
              "pass of their own per micro-batch); DeepSpeed's reduce_bucket_size of 5e8 elements"),
    Framework("deepspeed", True, False, False, lambda dp: 500_000_000,
              "DeepSpeed ZeRO with a PyTorch model: fused attention, autograd's accumulation, "
              "reduce_bucket_size 5e8 elements (its default)"),
    Framework("torchtitan", True, False, False, lambda dp: _MB_ELEMENTS,
              "torchtitan / PyTorch FSDP (llm-foundry): SDPA or FlashAttention, autograd's accumulation, "
              "FSDP's units (ZeRO-3: no size buckets), DDP's 25 MB otherwise"),
)}


def framework(name: str, flag: str = "--framework") -> Framework:
    """The profile called `name`; one line naming the valid ones otherwise."""
    found = FRAMEWORKS.get(name.strip().lower())
    if found is None:
        raise ConfigError(f"{flag} {name}: valid: {', '.join(FRAMEWORKS)}")
    return found
