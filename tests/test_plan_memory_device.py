"""Memory as a device sees it (issue 54, items 4 and 5): the optimizers' states (Lion, Adafactor),
the last stage's activations (the final norm, one chunk of fp32 logits), and what a device holds
beside the tensors (the CUDA context, NCCL's buffers, the caching allocator's reserve).

Counted by hand on a model small enough to list, and against the runtime's own rules: the model's
parameter shapes built on the meta device, the loss's chunks (strata/model/loss.chunk_bounds)."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
from architectures import ARCHITECTURES

from strata.errors import ConfigError
from strata.model.config import ModelConfig
from strata.model.loss import LOGITS_CHUNK_BYTES as RUNTIME_CHUNK_BYTES
from strata.model.loss import chunk_bounds
from strata.model.presets import get_preset
from strata.model.transformer import build_model
from strata.plan.cost import Cluster, Workload, estimate
from strata.plan.hardware import GB, get_device
from strata.plan.memory import (
    LOGITS_CHUNK_BYTES,
    head_activation_bytes,
    held_state_bytes,
    loss_logits_bytes,
    optimizer_bytes_per_param,
    parameter_shapes,
)
from strata.plan.report import parse_layout
from strata.rules.layout import Layout
from strata.rules.optimizers import check_optimizer, state_bytes

# One block, small enough to list every parameter: embedding (10, 4), attn_norm (4,), wq wk wv wo
# (4, 4) (2 heads of 2, 2 KV heads), mlp_norm (4,), w_gate w_up (8, 4), w_down (4, 8), final
# norm (4,), head (10, 4): 40 + 4 + 64 + 4 + 96 + 4 + 40 = 252 parameters.
SMALL = ModelConfig(vocab_size=10, n_layers=1, d_model=4, n_heads=2, d_ff=8, max_seq_len=16)
SMALL_PARAMS = 252
# Adafactor's factored second moment: matrices rows + columns, vectors whole:
# embedding 10+4, 3 norms 4 each, 4 projections 4+4, gate and up 8+4, down 4+8, head 10+4 = 108
SMALL_FACTORED = 14 + 12 + 32 + 36 + 14


def test_the_small_models_shapes_are_the_ones_counted_by_hand():
    assert SMALL.num_params() == sum(math.prod(s) for s in parameter_shapes(SMALL)) == SMALL_PARAMS


@pytest.mark.parametrize("optimizer,expected", [
    ("adamw", 8 * SMALL_PARAMS), ("sgd", 4 * SMALL_PARAMS), ("lion", 4 * SMALL_PARAMS),
    ("adafactor", 4 * SMALL_FACTORED), ("adafactor-momentum", 4 * (SMALL_FACTORED + SMALL_PARAMS)),
])
def test_optimizer_states_counted_by_hand(optimizer, expected):
    """Lion one fp32 momentum; Adafactor r + c fp32 values per (r, c) matrix (first moment off),
    a vector's whole second moment; on one device, the estimate's optimizer states are exactly that."""
    assert state_bytes(optimizer, parameter_shapes(SMALL)) == expected
    assert optimizer_bytes_per_param(optimizer, SMALL) * SMALL_PARAMS == pytest.approx(expected, rel=1e-12)
    work = Workload(SMALL, 1, 16, "bf16", optimizer)
    e = estimate(work, Cluster(get_device("A100-80G"), 1, 1, 25e9, 25e9), Layout())
    assert e.memory_breakdown["optimizer_states"] == pytest.approx(expected, rel=1e-12)


def test_a_stacked_experts_tensor_is_factored_over_its_last_two_dimensions():
    """(n, r, c): n(r + c) second-moment values, as transformers' Adafactor factors it."""
    assert state_bytes("adafactor", [(8, 32, 16)]) == 4 * 8 * (32 + 16)
    assert state_bytes("lion", [(8, 32, 16)]) == 4 * 8 * 32 * 16


def test_zero_shards_adafactors_states_like_any_others():
    rate = optimizer_bytes_per_param("adafactor", SMALL)
    one = held_state_bytes(SMALL_PARAMS, 0, 4, "mixed", rate)
    sharded = held_state_bytes(SMALL_PARAMS, 1, 4, "mixed", rate)
    assert one.optimizer == pytest.approx(4 * SMALL_FACTORED) and sharded.optimizer == pytest.approx(SMALL_FACTORED)


@pytest.mark.parametrize("name", [*ARCHITECTURES, "tiny-moe", "qwen2-moe-a2.7b", "gpt-j-6b", "bloom-176b"])
def test_parameter_shapes_are_the_runtime_models(name):
    """The planner's shapes, from the config alone, against the parameters of strata's model of
    that config built on the meta device: the same multiset."""
    cfg = ARCHITECTURES.get(name) or get_preset(name)
    model = build_model(cfg, seed=None)
    assert Counter(parameter_shapes(cfg)) == Counter(tuple(p.shape) for p in model.parameters())


def test_an_optimizer_the_planner_does_not_know_is_refused_in_one_line():
    with pytest.raises(ConfigError) as refused:
        check_optimizer("adam")
    message = refused.value.render(lambda field, value: f"--{field} {value}")
    assert message.startswith("--optimizer adam: valid: adamw (two fp32 moments; the default), sgd")
    assert "lion (one momentum)" in message and "adafactor (factored second moment" in message
    # the trainer runs AdamW alone: the table says so for whichever command takes the flag
    with pytest.raises(ConfigError, match="valid: adamw"):
        check_optimizer("lion", planning=False)


# --- the last stage's activations --------------------------------------------------------------------
def test_the_planners_chunk_is_the_runtimes():
    assert LOGITS_CHUNK_BYTES == RUNTIME_CHUNK_BYTES  # one constant (rules/constants.py), read by both
    for rows, positions, width in ((1, 8192, 128256), (4, 2048, 16032), (2, 31, 251), (1, 131072, 32000)):
        bounds = chunk_bounds(rows, positions, width)
        chunk = positions if bounds is None else bounds[0][1] - bounds[0][0]
        assert loss_logits_bytes(rows, positions, width) == 4 * rows * chunk * width


def test_the_last_stage_keeps_the_final_norm_and_one_chunk_of_fp32_logits():
    """tiny on one device, no recomputation: L blocks (Korthikanti's 34·sbh, fused attention) +
    the embedding's output + the final norm's input and output + the fp32 logits, 4 bytes each and
    not 6 (the 16-bit logits are freed once the loss has its copy). Llama 3 8B's logits at 8,192
    tokens pass the chunk: one chunk of 523 positions."""
    cfg = get_preset("tiny")
    b, s, h, bf16 = 2, 64, cfg.d_model, 2
    work = Workload(cfg, b, s, "bf16")
    e = estimate(work, Cluster(get_device("A100-80G"), 1, 1, 25e9, 25e9), parse_layout(f"mb={b}", work, 1))
    sbh = s * b * h
    by_hand = cfg.n_layers * 34 * sbh + sbh * bf16 + 2 * sbh * bf16 + 4 * b * s * cfg.vocab_size
    assert e.memory_breakdown["activations"] == by_hand
    assert head_activation_bytes(b * s, h, bf16) == 2 * sbh * bf16
    width = 128256
    assert loss_logits_bytes(1, 8192, width) == 4 * 523 * width  # 268,435,456 // (4 x 128,256) = 523
    assert loss_logits_bytes(1, 8192, width, None) == 4 * 8192 * width  # a loss that keeps them all


def test_megatrons_whole_logits_against_strata_chunk():
    """The same layout priced with the whole logits kept (a published Megatron run) holds the
    difference between all of them and one chunk, in fp32, on its last stage only."""
    cfg = get_preset("llama3-8b")
    chunked = Workload(cfg, 8, 8192, "bf16")
    whole = dataclasses.replace(chunked, logits_chunk_bytes=None)
    cluster = Cluster(get_device("H100-80G"), 1, 8, 450e9, 50e9)
    text = "tp=8,sp,mb=1"
    a, b = (estimate(w, cluster, parse_layout(text, w, 8)) for w in (chunked, whole))
    width = math.ceil(cfg.vocab_size / 8)
    assert b.memory_breakdown["activations"] - a.memory_breakdown["activations"] == \
        4 * width * 8192 - loss_logits_bytes(1, 8192, width)


# --- what the device holds beside the tensors -------------------------------------------------------
def test_the_device_holds_a_context_nccls_buffers_and_the_allocators_reserve():
    """dp 2 x tp 2 x pp 2: three process groups of more than one rank, 1 GB of NCCL buffers each;
    0.5 GB of CUDA context; 10% of the tensors held back by the caching allocator."""
    cfg = get_preset("tiny")
    work = Workload(cfg, 8, 64, "bf16")
    e = estimate(work, Cluster(get_device("A100-80G"), 1, 8, 25e9, 25e9), parse_layout("dp=2,tp=2,pp=2,mb=1", work, 8))
    tensors = e.memory_bytes_per_device
    assert e.device_overhead == {"cuda_context": 0.5 * GB, "nccl_buffers": 3 * GB, "allocator_reserve": 0.1 * tensors}
    assert e.device_memory_bytes == pytest.approx(tensors * 1.1 + 3.5 * GB, rel=1e-12)
    assert e.to_json()["device_memory_bytes"] == e.device_memory_bytes
    one = estimate(work, Cluster(get_device("A100-80G"), 1, 1, 25e9, 25e9), parse_layout("mb=1", work, 1))
    assert set(one.device_overhead) == {"cuda_context", "allocator_reserve"}  # no communicator


def test_a_layout_fits_only_with_room_for_the_devices_own_use():
    """The same layout on a device whose memory is its tensors alone does not fit, and says why;
    with room for the overhead too, it fits. cpu-local has no context, NCCL or caching allocator."""
    cfg = get_preset("small")
    work = Workload(cfg, 8, 256, "bf16")
    lay = Layout(dp=2, micro_batch=1)
    device = get_device("A100-80G")
    probe = estimate(work, Cluster(device, 1, 2, 25e9, 25e9), lay)
    tight = dataclasses.replace(device, memory_bytes=probe.memory_bytes_per_device)
    roomy = dataclasses.replace(device, memory_bytes=probe.device_memory_bytes)
    refused = estimate(work, Cluster(tight, 1, 2, 25e9, 25e9), lay)
    assert not refused.fits and refused.memory_bytes_per_device <= tight.memory_bytes
    assert any(n.startswith("does not fit:") and "GB cuda context" in n and "allocator reserve" in n
               for n in refused.notes)
    assert estimate(work, Cluster(roomy, 1, 2, 25e9, 25e9), lay).fits
    bare = dataclasses.replace(tight, context_bytes=0.0, group_bytes=0.0, allocator_reserve=0.0)
    on_cpu = estimate(work, Cluster(bare, 1, 2, 25e9, 25e9), lay)
    assert on_cpu.fits and on_cpu.device_overhead == {}
