"""Single-process speed: strata's trainer against a plain-PyTorch training loop of the same model.

The reference is written here independently, the way a user would write it with nothing but
PyTorch (nanoGPT-style: one module, SDPA attention, AdamW, clipping); it has the same shape and
parameter count as strata's `small` preset. Both train on the same synthetic tokens, alternately
(A, B, A, B, ...) in one process, so machine noise hits both alike; we report the median step time.

  python bench/single_process.py [--rounds 3] [--steps 6] [--dtypes fp32 bf16]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from strata.config import train_config
from strata.model.presets import get_preset
from strata.train.trainer import train


class RefBlock(nn.Module):
    def __init__(self, d, heads, kv_heads, ff):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv = nn.Linear(d, d + 2 * kv_heads * self.hd, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * ff, bias=False)
        self.down = nn.Linear(ff, d, bias=False)

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        q, k, v = self.qkv(self.n1(x)).split([d, self.kv_heads * self.hd, self.kv_heads * self.hd], -1)
        q, k, v = (t.view(b, s, -1, self.hd).transpose(1, 2) for t in (q, k, v))
        rot = lambda t: torch.cat([-t[..., self.hd // 2:], t[..., :self.hd // 2]], -1)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(self.n2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class RefModel(nn.Module):
    def __init__(self, vocab, layers, d, heads, kv_heads, ff, seq):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(RefBlock(d, heads, kv_heads, ff) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)
        inv = 1.0 / 10000 ** (torch.arange(0, d // heads, 2) / (d // heads))
        ang = torch.outer(torch.arange(seq).float(), inv).repeat(1, 2)
        self.register_buffer("cos", ang.cos()), self.register_buffer("sin", ang.sin())
        for p in self.parameters():
            nn.init.normal_(p, std=0.02) if p.dim() > 1 else nn.init.ones_(p)

    def forward(self, idx, targets):
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x, self.cos[: idx.shape[1]], self.sin[: idx.shape[1]])
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def reference_step_times(dtype: str, steps: int, batch: int, seq: int) -> list[float]:
    cfg = get_preset("small")
    torch.manual_seed(0)
    model = RefModel(cfg.vocab_size, cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.d_ff, seq)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        idx = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
        with amp:
            loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times


def strata_step_times(dtype: str, steps: int, batch: int, seq: int) -> list[float]:
    cfg = train_config(model="small", data="synthetic", dtype=dtype, steps=steps, micro_batch=batch,
                      global_batch=batch, seq_len=seq, progress=False, eval_batches=1, peak_flops=1e12)
    return train(cfg)["step_times"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="steps per round; the first is warm-up")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    args = parser.parse_args()
    tokens = args.batch * args.seq
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, small preset, "
          f"batch {args.batch} x {args.seq} tokens, {args.rounds} alternating rounds of {args.steps} steps\n")
    print("| dtype | plain PyTorch tokens/s | strata tokens/s | strata / reference |")
    print("|---|---|---|---|")
    for dtype in args.dtypes:
        ref, ours = [], []
        for _ in range(args.rounds):
            ref += reference_step_times(dtype, args.steps, args.batch, args.seq)[1:]
            ours += strata_step_times(dtype, args.steps, args.batch, args.seq)[1:]
        ref_tps, our_tps = tokens / statistics.median(ref), tokens / statistics.median(ours)
        print(f"| {dtype} | {ref_tps:,.0f} | {our_tps:,.0f} | {our_tps / ref_tps:.3f} |", flush=True)


if __name__ == "__main__":
    main()
