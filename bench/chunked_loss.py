"""The memory of the loss at a 128K vocabulary, chunked and not (strata/model/loss.py): the bytes its
forward and backward allocate beyond their inputs and the weights, at their peak, counted tensor by
tensor (strata/memory/live_bytes.py) on the CPU, for a head of d_model 16 over a 131,072-token
vocabulary. tests/test_chunked_loss.py asserts on the same count.

  python bench/chunked_loss.py [--tokens 256] [--chunk-mib 8]
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from strata.memory.live_bytes import LiveBytes
from strata.model import loss as chunking
from strata.model.config import ModelConfig
from strata.model.transformer import build_model

VOCAB, WIDTH, ROWS = 131072, 16, 2


def loss_peak_bytes(budget: int | None, tie_embeddings: bool = False, positions: int = 128,
                    autocast: bool = False) -> dict[str, int]:
    """{"forward": peak bytes of the loss's forward, "peak": of its forward and backward} on ROWS x
    `positions` tokens, with chunks of `budget` bytes of fp32 logits (None: unchunked)."""
    cfg = ModelConfig(vocab_size=VOCAB, n_layers=1, d_model=WIDTH, n_heads=2, d_ff=32, max_seq_len=positions,
                      tie_embeddings=tie_embeddings)
    model = build_model(cfg, seed=0)
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(ROWS, positions, WIDTH, generator=generator, requires_grad=True)
    targets = torch.randint(0, VOCAB, (ROWS, positions), generator=generator)
    before = chunking.LOGITS_CHUNK_BYTES
    chunking.LOGITS_CHUNK_BYTES = 2**62 if budget is None else budget
    try:
        with LiveBytes() as counted:
            with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
                loss = model.loss(h, targets)
            forward = counted.peak
            loss.backward()
    finally:
        chunking.LOGITS_CHUNK_BYTES = before
    return {"forward": forward, "peak": counted.peak}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=256, help="tokens in all (2 sequences)")
    p.add_argument("--chunk-mib", type=float, default=8.0, help="fp32 logits per chunk")
    args = p.parse_args()
    positions, budget = args.tokens // ROWS, int(args.chunk_mib * 2**20)
    mib = 2**20
    print(f"{ROWS} x {positions} tokens, vocabulary {VOCAB}, d_model {WIDTH}: whole fp32 logits "
          f"{ROWS * positions * VOCAB * 4 / mib:.0f} MiB, head weight {VOCAB * WIDTH * 4 / mib:.0f} MiB")
    print(f"{'':38s}{'forward peak':>14s}{'fwd+bwd peak':>14s}")
    for autocast in (False, True):
        for tie in (False, True):
            for chunk in (None, budget):
                counted = loss_peak_bytes(chunk, tie, positions, autocast)
                label = f"{'bf16 autocast' if autocast else 'fp32'}, {'tied' if tie else 'untied'}, " + \
                    ("unchunked" if chunk is None else f"{args.chunk_mib:g} MiB chunks")
                print(f"{label:38s}{counted['forward'] / mib:11.1f} MiB{counted['peak'] / mib:11.1f} MiB")


if __name__ == "__main__":
    main()
