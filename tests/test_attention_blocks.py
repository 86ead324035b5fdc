"""Windowed and ALiBi attention in one process by blocks (strata/model/attention_blocks.py): equal
to one attention with the whole mask (fp64), without an S x S mask or score matrix (counted), and
the CUDA kernels' calls checked on meta tensors (their signatures and the shapes they return)."""

import pytest
import torch
import torch.nn.functional as F

from strata.model import attention_blocks as ab
from strata.model.layers import alibi_slopes, attention_bias


def _inputs(heads, kv_heads, seq, dtype=torch.float64, device="cpu", d=8):
    torch.manual_seed(0)
    q = torch.randn(2, heads, seq, d, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, seq, d, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    return q, k, v


def _reference(q, k, v, window, slopes):
    mask = attention_bias(q.shape[2], 0, None, slopes, q.dtype, q.device, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _output_and_grads(run, q, k, v, grad):
    for t in (q, k, v):
        t.grad = None
    out = run(q, k, v)
    out.backward(grad)
    return [out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()]


@pytest.mark.parametrize("window,alibi,kv_heads,chunk", [
    (5, False, 2, 4),      # a window shorter than a chunk: the diagonal blocks need the window's mask
    (8, False, 2, 4),      # a window of two chunks: blocks wholly inside it need no mask
    (11, False, 4, 8),     # rows of a block that see none of its keys
    (None, True, 4, 8),    # ALiBi: every block carries its distances
    (13, True, 2, 4),      # both, grouped heads
])
def test_blocked_attention_equals_one_attention_with_the_whole_mask(window, alibi, kv_heads, chunk):
    """fp64 to 1e-10: the output and the gradients of q, k and v, over a 32-position sequence cut
    into chunks of 4 or 8, against SDPA with the (S, S) mask attention_bias makes."""
    heads, seq = 4, 32
    slopes = alibi_slopes(heads) if alibi else None
    q, k, v = _inputs(heads, kv_heads, seq)
    grad = torch.randn(2, heads, seq, 8, dtype=torch.float64)
    theirs = _output_and_grads(lambda *t: _reference(*t, window, slopes), q, k, v, grad)
    ours = _output_and_grads(lambda *t: ab.causal_attention(*t, ab.CausalMask(window, slopes), chunk=chunk),
                             q, k, v, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_the_blocks_hold_no_sequence_square():
    """Counted: a 256-position sequence with a window of 32 in chunks of 8 computes 256 x 36 score
    elements at most per head (the window and one chunk's edge; 256 x 256 / 2 for causal
    attention), and its largest mask is one chunk's (8 x 8), never (256, 256)."""
    seq, window, chunk = 256, 32, 8
    chunks = ab.one_process_chunks(seq, window, chunk)
    found = list(ab.blocks(chunks, chunks, window, None, torch.float32, "cpu"))
    scores = sum((b.q.stop - b.q.start) * (b.k.stop - b.k.start) for b in found)
    assert scores <= seq * (window + chunk // 2 + chunk), scores
    assert max(b.bias.numel() for b in found if b.bias is not None) == chunk * chunk
    masked = sum(b.bias is not None for b in found)
    assert masked == len(chunks) - window // chunk, masked  # one window edge per query chunk that has one
    plain = sum(b.bias is None and not b.causal for b in found)
    assert plain > masked  # most blocks run without a mask


def test_default_chunks():
    """A quarter of the window, or an eighth of the sequence with ALiBi; never under
    ONE_PROCESS_CHUNK; a sequence that does not halve is one chunk."""
    assert ab.one_process_chunks(32768, 4096)[0] == (0, 1024)
    assert ab.one_process_chunks(2048, None)[0] == (0, 256)
    assert ab.one_process_chunks(512, 64)[0] == (0, ab.ONE_PROCESS_CHUNK)
    assert ab.one_process_chunks(30, 8, chunk=4) == [(0, 15), (15, 30)]


def test_a_model_with_a_window_trains_the_same_in_blocks(monkeypatch):
    """A Mistral-shaped tiny model (window 8, grouped heads) over 32 positions: its loss and every
    gradient with attention by chunks of 4 equal those of the one-chunk computation (fp64)."""
    from strata.model.config import ModelConfig
    from strata.model.transformer import build_model
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32,
                      sliding_window=8)
    model = build_model(cfg, dtype=torch.float64, seed=0)
    tokens = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(0))
    calls = []
    forward = ab.CpuFlash.forward
    monkeypatch.setattr(ab.CpuFlash, "forward", staticmethod(lambda *a: calls.append(1) or forward(*a)))

    def loss_and_grads(chunk):
        calls.clear()
        monkeypatch.setattr(ab, "ONE_PROCESS_CHUNK", chunk)
        model.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    whole, whole_grads = loss_and_grads(10**6)
    assert len(calls) == 2  # one block a layer
    blocked, blocked_grads = loss_and_grads(4)
    # a layer's 8 chunks of 4: each its causal diagonal (8), the chunk before it, wholly inside the
    # window (7, no mask), and the window's edge two chunks back (6, masked)
    assert len(calls) == 2 * (8 + 7 + 6), len(calls)
    torch.testing.assert_close(blocked, whole, rtol=1e-10, atol=0)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(blocked_grads[name], grad, rtol=1e-10, atol=1e-12, msg=name)


# --- the CUDA kernels, on meta tensors ------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window,alibi", [(None, False), (40, False), (None, True)])
def test_the_cuda_kernels_calls_on_meta_tensors(dtype, window, alibi):
    """SDPA's CUDA kernels, called below SDPA, on meta tensors: every block of the ring's reference
    (cp 4, grouped heads: 8 query heads over 2 KV heads) goes through the flash kernel (16-bit, no
    mask) or the memory-efficient one (fp32 or a mask) and its backward, and the output and the
    gradients come back in the inputs' shapes and dtypes. The numbers are bench/gpu_check.py's."""
    from strata.parallel.ring_attention import blocks_in_one_process
    heads, kv_heads, seq, d = 8, 2, 160, 64  # 20 positions a chunk: neither 16 nor 32 divides it
    q, k, v = (t.detach() for t in _inputs(heads, kv_heads, seq, dtype=dtype, device="meta", d=d))
    assert ab.kernel_for(q) is ab.CudaFused
    slopes = alibi_slopes(heads) if alibi else None
    calls = {"flash": 0, "efficient": 0}

    class Counting(ab.CudaFused):
        @classmethod
        def forward(cls, q, k, v, block, scale):
            calls["flash" if cls._flash(q, block) else "efficient"] += 1
            return super().forward(q, k, v, block, scale)

    out, dq, dk, dv = blocks_in_one_process(q, k, v, torch.empty_like(q), 4, window, slopes, Counting)
    assert (out.shape, dq.shape, dk.shape, dv.shape) == (q.shape, q.shape, k.shape, v.shape)
    assert {t.dtype for t in (out, dq, dk, dv)} == {dtype}
    if dtype == torch.bfloat16 and not alibi:
        assert calls["flash"] > 0  # the blocks without a mask read grouped heads in place
        assert (calls["efficient"] > 0) == (window is not None)  # only a window's edges carry a mask
    else:
        assert calls["flash"] == 0 and calls["efficient"] > 0


def test_the_kernel_for_each_device_and_dtype():
    q = torch.empty(1, 2, 4, 8)
    assert ab.kernel_for(q) is ab.CpuFlash
    assert ab.kernel_for(q.to("meta", torch.float64)) is ab.Blockwise  # fp64: no fused CUDA kernel
    assert ab.kernel_for(torch.empty(1, 2, 4, 12, device="meta")) is ab.Blockwise  # head size not a multiple of 8
