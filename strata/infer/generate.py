"""Sampling from a model with a KV cache: one forward over the prompt (prefill), then one position
at a time (decode), each step reading the cached keys and values instead of recomputing them."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from strata.infer.kv_cache import make_caches


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                generator: torch.Generator | None) -> torch.Tensor:
    """logits: (batch, vocab) -> (batch,) next ids. temperature 0 is greedy."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already cover top_p of the mass
        drop = probs.cumsum(-1) - probs > top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             stop: Callable[[int], bool] | None = None) -> Iterator[torch.Tensor]:
    """Yield the next ids, (batch,), one step at a time. prompt_ids: (batch, prompt_len)."""
    model.eval()
    batch, prompt_len = prompt_ids.shape
    max_len = min(prompt_len + max_new_tokens, model.cfg.max_seq_len)
    if prompt_len >= model.cfg.max_seq_len:
        raise ValueError(f"prompt of {prompt_len} tokens leaves no room in the model's "
                         f"{model.cfg.max_seq_len}-position context")
    caches = make_caches(model, batch, max_len)
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    logits = model(prompt_ids.to(device), caches=caches)[:, -1]
    new_tokens = max_len - prompt_len
    for i in range(new_tokens):
        next_ids = sample_next(logits, temperature, top_k, top_p, generator)
        yield next_ids
        if i == new_tokens - 1 or (stop is not None and stop(int(next_ids[0]))):
            return
        logits = model(next_ids[:, None], caches=caches)[:, -1]
