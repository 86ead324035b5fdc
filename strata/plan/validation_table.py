"""The planner's one validation table (docs/cost-model.md, "Validation"; issue 54): every published
run of strata/plan/published.py and published_unseen.py, and the production totals below, split
into a fit half and a held-out half by a fixed rule, so no row is placed by hand:

  a row is in the fit half when the first byte of the SHA-256 of its name (UTF-8) is even.

bench/validation.py --fit sets the planner's fitted defaults (hardware.TRAINING_GEMM_SHARE,
BANDWIDTH_FRACTION, GEMM_OVERHEAD_S) from the fit half only; the held-out half measures the model.

A production total compares the device-hours a source gives for a run's tokens with the expected
device-hours the planner prices for them at the published layout: the steady state plus
checkpoints, evaluation and failures at the goodput defaults (strata/plan/goodput.py). Where a
source gives no layout, the row records the layout `strata plan` picks for the published cluster
and batch (priced as strata runs it), and says so."""

from __future__ import annotations

import hashlib
from dataclasses import replace

from strata.model.config import ModelConfig
from strata.model.presets import get_preset
from strata.plan.published import RUNS, PublishedRun, _llama
from strata.plan.published_unseen import UNSEEN_RUNS
from strata.rules.layout import Layout

_BLOOM = next(r for r in RUNS if r.name.startswith("BLOOM"))


def _total(run: PublishedRun, name: str, source: str, tokens: float, hours: float, device: str) -> PublishedRun:
    """A production total: `hours` device-hours for `tokens` tokens, as the row's throughput over
    the whole run (tokens per device-second)."""
    return replace(run, name=name, source=source, run_tokens=tokens, device_hours=hours,
                   published=f"{hours:,.0f} {device}-hours for {tokens / 1e9:,.0f}B tokens",
                   tokens_per_s=tokens / (hours * 3600))


def _picked(name: str, model: ModelConfig, gpus: int, batch: int, seq: int, layout: Layout, source: str,
            tokens: float, hours: float) -> PublishedRun:
    """A Llama run whose source gives the cluster and the batch but no layout: the layout `strata
    plan --nodes 256 --nics-per-node 8` picks at the fitted defaults, recorded, priced as strata
    runs it."""
    run = PublishedRun(name, source, "strata (the planner's pick)", model, "A100-80G", gpus, "ib-200", 8,
                       layout, batch, seq, True, "", 0.0, fabric="200 Gb/s InfiniBand (RSC) or RoCE")
    return _total(run, name, source, tokens, hours, "A100-80GB")


def _llama3_405b() -> PublishedRun:
    """Llama 3.1 405B (Dubey et al. 2024, Table 4): 16,384 H100, tp 8, pp 16, dp 128, 8,192 tokens,
    16M tokens per batch. Interleaved with one layer to a chunk (section 3.3.2: the first and last
    stages hold one layer fewer, so that the first chunk of the first stage holds only the
    embedding and the last chunk of the last stage only the output and loss): 126 layers and those
    two in 16 stages, 8 chunks each."""
    layout = Layout(dp=128, tp=8, pp=16, virtual_stages=8, schedule="interleaved", zero=1, micro_batch=1,
                    sequence_parallel=True, reduce_dtype="bf16", gather_dtype="bf16")
    run = PublishedRun("Llama 3.1 405B run total, 16384 H100",
                       "Llama 3.1 model card (H100-80GB hours); Dubey et al. 2024, Table 4 and section 3.3",
                       "Meta's Llama 3 stack (PyTorch 4D)", get_preset("llama3.1-405b"), "H100-80G", 16384, "ib-400", 8,
                       layout, 2048, 8192, True, "", 0.0, fabric="8 x 400 Gb/s RoCE")
    return _total(run, run.name, run.source, 15.6e12, 30.84e6, "H100-80GB")


_LLAMA = "Touvron et al. 2023 (LLaMA, Table 15: 2,048 A100-80GB); layout: strata plan's pick"
_LLAMA2 = "Touvron et al. 2023 (Llama 2, Table 2; GPUs as LLaMA's 2,048); layout: strata plan's pick"
_PICK_65B = Layout(dp=256, tp=8, zero=3, micro_batch=8, sequence_parallel=True)
_PICK_70B = Layout(dp=256, tp=8, zero=3, micro_batch=4, sequence_parallel=True)
_PICK_2_7B = Layout(dp=1024, tp=2, micro_batch=1, sequence_parallel=True)
_PICK_2_13B = Layout(dp=512, tp=4, micro_batch=2, sequence_parallel=True)

TOTALS: tuple[PublishedRun, ...] = (
    _total(_BLOOM, "BLOOM 176B run total, 384 A100", "BigScience 2022 (BLOOM, arXiv 2211.05100, sections 3.4-3.5)",
           366e9, 1_082_990, "A100-80GB"),
    _picked("LLaMA 65B run total, 2048 A100", get_preset("llama-65b"), 2048, 2048, 2048, _PICK_65B, _LLAMA, 1.4e12,
            1_022_362),
    _picked("Llama 2 7B run total, 2048 A100", _llama(32, 4096, 32, 32, 11008, 32000, 4096), 2048, 1024, 4096,
            _PICK_2_7B, _LLAMA2, 2e12, 184_320),
    _picked("Llama 2 13B run total, 2048 A100", _llama(40, 5120, 40, 40, 13824, 32000, 4096), 2048, 1024, 4096,
            _PICK_2_13B, _LLAMA2, 2e12, 368_640),
    _picked("Llama 2 70B run total, 2048 A100", get_preset("llama-70b"), 2048, 1024, 4096, _PICK_70B, _LLAMA2, 2e12,
            1_720_320),
    _llama3_405b(),
)

TABLE: tuple[PublishedRun, ...] = RUNS + UNSEEN_RUNS + TOTALS


def in_fit_half(name: str) -> bool:
    """The split rule: the first byte of sha256(name) is even."""
    return hashlib.sha256(name.encode()).digest()[0] % 2 == 0


def halves(rows: tuple[PublishedRun, ...] = TABLE) -> tuple[tuple[PublishedRun, ...], tuple[PublishedRun, ...]]:
    """(the fit half, the held-out half), each in table order."""
    return tuple(r for r in rows if in_fit_half(r.name)), tuple(r for r in rows if not in_fit_half(r.name))
