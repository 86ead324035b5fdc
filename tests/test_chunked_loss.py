"""The loss in chunks of the sequence (strata/model/loss.py): the same mean and gradients as the
unchunked loss (fp64 to 1e-10, one process and every layout that computes a loss), the head's
ZeRO-3 unit gathered and reduced as often as before, and, at a 128K vocabulary, the extra memory of
the loss's forward and backward counted: a chunk's, not the whole logits'."""

from __future__ import annotations

import contextlib
import functools
import os
import sys

import pytest
import torch
from architectures import ARCHITECTURES

from strata.config import train_config
from strata.model import loss as chunking
from strata.model.loss import chunk_bounds
from strata.model.presets import get_preset
from strata.model.transformer import build_model
from strata.train.trainer import train

from distributed import run_on_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from chunked_loss import ROWS, WIDTH, loss_peak_bytes  # noqa: E402
from chunked_loss import VOCAB as LARGE_VOCAB  # noqa: E402

VOCAB = 251  # padded to 252 under tp 2 and 4
# Two sequences of 32 positions: at most 5 positions of a 251-wide vocabulary per chunk (7 chunks,
# the last of 2), 10 of a tp rank's 126 columns, 10 of one sequence's.
CHUNK_BYTES = 4 * 2 * 256 * 5


@contextlib.contextmanager
def chunk_budget(nbytes: int | None):
    """Chunks of `nbytes` of fp32 logits (None: one chunk whatever the size); yields the number of
    chunks of each chunked loss computed meanwhile."""
    before, apply, chunks = chunking.LOGITS_CHUNK_BYTES, chunking._ChunkedLosses.apply, []

    def counted(losses_of, bounds, *args):
        chunks.append(len(bounds))
        return apply(losses_of, bounds, *args)

    chunking.LOGITS_CHUNK_BYTES = 2**62 if nbytes is None else nbytes
    chunking._ChunkedLosses.apply = counted
    try:
        yield chunks
    finally:
        chunking.LOGITS_CHUNK_BYTES = before
        del chunking._ChunkedLosses.apply  # Function's own again


def test_chunks_cover_the_sequence_in_order_and_one_chunk_is_no_chunking():
    assert chunk_bounds(2, 32, 251, budget=CHUNK_BYTES) == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 25),
                                                             (25, 30), (30, 32)]
    assert chunk_bounds(2, 32, 251, budget=4 * 2 * 251 * 32) is None  # all of it fits: the unchunked loss
    assert chunk_bounds(8, 4, 10**6, budget=1) == [(0, 1), (1, 2), (2, 3), (3, 4)]  # at least a position


# --- one process --------------------------------------------------------------------------------------
def _loss_and_grads(model, tokens, targets):
    model.zero_grad(set_to_none=True)
    loss = model(tokens, targets)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("name", [*ARCHITECTURES, "tiny-moe"])  # untied, tied with biases, Gemma's, experts...
def test_chunked_loss_and_gradients_equal_the_unchunked_in_fp64(name):
    cfg = ARCHITECTURES[name] if name in ARCHITECTURES else get_preset(name)
    model = build_model(cfg.with_overrides(vocab_size=VOCAB), dtype=torch.float64, seed=3)
    generator = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, VOCAB, (2, 32), generator=generator) for _ in range(2))
    with chunk_budget(None):
        loss, grads = _loss_and_grads(model, tokens, targets)
    with chunk_budget(CHUNK_BYTES) as chunks:
        chunked_loss, chunked_grads = _loss_and_grads(model, tokens, targets)
        with torch.no_grad():
            evaluated = model(tokens, targets)
    assert chunks == [7, 7]
    torch.testing.assert_close(chunked_loss, loss, rtol=1e-10, atol=0)
    torch.testing.assert_close(evaluated, loss, rtol=1e-10, atol=0)
    for key, grad in grads.items():
        torch.testing.assert_close(chunked_grads[key], grad, rtol=1e-10, atol=1e-12, msg=key)
    with torch.no_grad():  # generation's path is untouched: the logits, unchunked
        assert model(tokens).shape == (2, 32, VOCAB)


def test_chunks_recompute_under_the_forwards_autocast():
    """bf16 autocast over fp32 weights: each chunk's logits are recomputed in bf16 as the forward
    made them, and the gradients are the unchunked ones' to bf16's precision (the head's weight
    gradient is summed over the chunks in fp32, so it is rounded differently)."""
    model = build_model(get_preset("tiny").with_overrides(vocab_size=VOCAB), seed=3)
    tokens, targets = torch.randint(0, VOCAB, (2, 32)), torch.randint(0, VOCAB, (2, 32))
    runs = []
    for budget in (None, CHUNK_BYTES):
        with chunk_budget(budget), torch.autocast("cpu", dtype=torch.bfloat16):
            runs.append(_loss_and_grads(model, tokens, targets))
    (loss, grads), (chunked_loss, chunked_grads) = runs
    torch.testing.assert_close(chunked_loss, loss, rtol=1e-3, atol=0)
    for key, grad in grads.items():
        assert chunked_grads[key].dtype == torch.float32
        assert (chunked_grads[key] - grad).norm() <= 1e-2 * grad.norm(), key  # bf16 differs from fp32 by ~3e-3


# --- the memory, counted at a 128K vocabulary -----------------------------------------------------------
COUNTED_CHUNK_BYTES = 8 * 2**20  # 8 positions of 2 sequences: 16 chunks


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16 autocast"])
@pytest.mark.parametrize("tie_embeddings", [False, True], ids=["untied", "tied"])
def test_the_chunked_loss_holds_one_chunk_of_logits_at_a_128k_vocabulary(tie_embeddings, autocast):
    """The bytes the loss's forward and backward allocate beyond their inputs and the weights, at
    their peak, on 2 x 128 tokens of a 131,072-token vocabulary (bench/chunked_loss.py counts them).
    Unchunked: the whole fp32 logits, their log-softmax and their gradient (3 x 128 MiB). Chunked:
    what one chunk needs, one chunk at a time (its logits, their log-softmax, and the gradient: 3 x
    8 MiB), beside the head weight's gradient, summed over the chunks in place (8 MiB), and the
    hidden states' gradient."""
    logits = ROWS * 128 * LARGE_VOCAB * 4
    weight_grad, h_grad = LARGE_VOCAB * WIDTH * 4, ROWS * 128 * WIDTH * 4
    unchunked = loss_peak_bytes(None, tie_embeddings, autocast=autocast)
    assert unchunked["peak"] >= 3 * logits
    chunked = loss_peak_bytes(COUNTED_CHUNK_BYTES, tie_embeddings, autocast=autocast)
    assert chunked["forward"] <= 3 * COUNTED_CHUNK_BYTES  # fp32: logits and log-softmax; bf16: the bf16 logits too
    small = 2**16  # per-token losses, a chunk's targets and hidden states: tens of KiB
    assert chunked["peak"] <= 3 * COUNTED_CHUNK_BYTES + weight_grad + h_grad + small
    assert chunked["peak"] * 10 < unchunked["peak"]


# --- every layout that computes a loss ------------------------------------------------------------------
BASE = dict(model="tiny", seq_len=32, steps=3, progress=False, peak_flops=1e10, eval_batches=1, lr=3e-3, seed=7,
            vocab_size=VOCAB, global_batch=4, micro_batch=2, grad_clip=0.5, dtype="fp64")


def _train(settings: dict, budget: int | None) -> dict:
    with chunk_budget(budget) as chunks:
        s = train(train_config(**{**BASE, **settings}), keep_state=True)
    return {"losses": s["losses"], "val": s["val_losses"], "state": s["state"], "record": s["records"][-1],
            "chunks": chunks}


@functools.lru_cache(maxsize=None)
def unchunked(model: str) -> dict:
    return _train({"model": model}, None)


def _chunked_runs(layouts: list[dict]) -> list[dict]:
    return [_train(layout, CHUNK_BYTES) for layout in layouts]


def _assert_reproduces(run: dict, reference: dict) -> None:
    torch.testing.assert_close(run["losses"], reference["losses"], rtol=1e-10, atol=0)
    torch.testing.assert_close(run["val"], reference["val"], rtol=1e-10, atol=0)
    for name, value in reference["state"].items():
        torch.testing.assert_close(run["state"][name], value, rtol=1e-8, atol=1e-10, msg=name)


def test_a_chunked_single_process_run_reproduces_the_unchunked():
    run, reference = _train({}, CHUNK_BYTES), unchunked("tiny")
    assert run["chunks"] and set(run["chunks"]) == {7} and reference["chunks"] == []
    _assert_reproduces(run, reference)


TWO_RANKS = [dict(tp=2), dict(tp=2, sequence_parallel=True),
             dict(model="tiny-gpt2", tp=2, sequence_parallel=True),  # tied embeddings, biases
             dict(dp=2, zero=3), dict(model="tiny-gpt2", dp=2, zero=3),
             dict(pp=2, global_batch=6, micro_batch=1), dict(pp=2, schedule="zb", global_batch=6, micro_batch=1),
             dict(cp=2)]
FOUR_RANKS = [dict(tp=4, tp_mode="2d"), dict(model="tiny-gpt2", tp=4, tp_mode="2d")]  # grid heads, tied


@pytest.mark.parametrize("world,layouts", [(2, TWO_RANKS), (4, FOUR_RANKS)], ids=["2 ranks", "4 ranks"])
def test_chunked_runs_under_each_layout_reproduce_the_unchunked_single_process_run(world, layouts):
    per_rank = run_on_ranks(_chunked_runs, world, layouts, timeout=900)
    for index, layout in enumerate(layouts):
        settings = {k: v for k, v in layout.items() if k in ("global_batch", "micro_batch")}
        reference = unchunked(layout.get("model", "tiny")) if not settings else \
            _train({"model": layout.get("model", "tiny"), **settings}, None)
        last_stage = per_rank[-1:] if "pp" in layout else per_rank  # the others compute no loss
        assert all(rank[index]["chunks"] and min(rank[index]["chunks"]) > 1 for rank in last_stage), layout
        for rank in per_rank:
            _assert_reproduces(rank[index], reference)


def test_zero3_gathers_and_reduces_the_heads_unit_as_often_chunked():
    """ZeRO-3 (here ZeRO-Infinity's parameter tier on one process, which counts what each unit
    reads): the head's hooks fire once around the chunks, so every unit is read once per forward
    and once per backward, as unchunked, and the gradients written are the same."""
    offloaded = dict(offload_params="cpu", micro_batch=1, checkpointing="full")
    plain, chunked = (_train(offloaded, budget) for budget in (None, CHUNK_BYTES // 2))
    assert chunked["chunks"] and min(chunked["chunks"]) > 1
    _assert_reproduces(chunked, plain)
    assert chunked["record"]["offload"]["read_bytes"] == plain["record"]["offload"]["read_bytes"]
    assert chunked["record"]["offload"]["written_bytes"] == plain["record"]["offload"]["written_bytes"]
