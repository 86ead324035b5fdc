"""Batched generation with a KV cache: one forward over the (left-padded) prompts (prefill), then
one position at a time (decode), each step reading the cached keys and values instead of
recomputing them.

Sampling is per row with a generator seeded by (seed, row): a request's answer does not depend
on which other requests share its batch, nor on the layout (one process, tensor or pipeline
parallel, micro-batches), so every layout can be tested against one process token for token."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from strata.errors import ConfigError
from strata.infer.kv_cache import KVCache

FINISHED = -1  # the id reported for a row that has already stopped


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0  # CTRL's (Keskar et al. 2019): > 1 discourages seen tokens
    seed: int = 0

    def problems(self) -> list[str]:
        """What is wrong with these settings, one line each (empty when valid)."""
        checks = [(0 <= self.temperature < float("inf"), f"--temperature {self.temperature}: must be finite and >= 0 "
                                                          f"(0 is greedy)"),
                  (self.top_k is None or self.top_k >= 1, f"--top-k {self.top_k}: must be >= 1"),
                  (self.top_p is None or 0 < self.top_p <= 1, f"--top-p {self.top_p}: must be in (0, 1]"),
                  *((self.temperature > 0 or value is None, f"--{flag} {value}: only with --temperature > 0 (at 0, "
                                                            f"decoding is greedy: it takes the likeliest token)")
                    for flag, value in (("top-k", self.top_k), ("top-p", self.top_p))),
                  (0 < self.repetition_penalty < float("inf"), f"--repetition-penalty {self.repetition_penalty}: must be > 0 "
                                                f"(1 is none; 1.1-1.3 is usual)")]
        return [message for ok, message in checks if not ok]


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, longest) ids with each prompt at the right end, and each row's padding count."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
    return ids, torch.tensor([longest - len(p) for p in prompts], dtype=torch.long)


class Sampler:
    """Chooses each row's next token and tracks which rows have stopped. stop(row, answer ids)
    says whether a row's answer is complete (a stop string or an end-of-text token)."""

    def __init__(self, prompts: list[list[int]], vocab_size: int, max_new_tokens: int, sampling: Sampling,
                 stop: Callable[[int, list[int]], bool] | None = None, first_row: int = 0):
        self.sampling, self.stop, self.max_new_tokens = sampling, stop, max_new_tokens
        rows = range(first_row, first_row + len(prompts))
        # a row's stream: (seed, row) folded into the 64 bits a generator's seed holds
        self.generators = [torch.Generator().manual_seed((sampling.seed * 1_000_003 + row) % 2**64) for row in rows]
        self.answers: list[list[int]] = [[] for _ in prompts]
        self.finished = [False] * len(prompts)
        self.first_row = first_row
        self.seen = None
        if sampling.repetition_penalty != 1.0:  # the prompt counts as seen, as in transformers
            self.seen = torch.zeros(len(prompts), vocab_size, dtype=torch.bool)
            for row, prompt in enumerate(prompts):
                self.seen[row, prompt] = True

    @property
    def done(self) -> bool:
        return all(self.finished)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (batch, vocab) of the last position -> (batch,) next ids, FINISHED for rows that
        had stopped before this step."""
        s = self.sampling
        logits = logits.float()
        if self.seen is not None:
            seen = self.seen.to(logits.device)
            penalised = torch.where(logits > 0, logits / s.repetition_penalty, logits * s.repetition_penalty)
            logits = torch.where(seen, penalised, logits)
        if s.temperature == 0:
            next_ids = logits.argmax(dim=-1).cpu()
        else:
            # shifted so the largest is 0 (softmax is the same for any shift), and divided in fp64:
            # a tiny temperature then sends the others to -inf, where in fp32 it would round to 0
            # and give 0/0
            shifted = (logits - logits.amax(dim=-1, keepdim=True)).double()
            probs = _filtered(shifted / s.temperature, s.top_k, s.top_p).softmax(-1).cpu()
            next_ids = torch.stack([torch.multinomial(probs[row], 1, generator=g)[0]
                                    for row, g in enumerate(self.generators)])
        for row, token in enumerate(next_ids.tolist()):
            if self.finished[row]:
                next_ids[row] = FINISHED
                continue
            self.answers[row].append(token)
            if self.seen is not None:
                self.seen[row, token] = True
            if len(self.answers[row]) >= self.max_new_tokens or \
                    (self.stop is not None and self.stop(self.first_row + row, self.answers[row])):
                self.finished[row] = True
        return next_ids


def _filtered(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Logits with the tokens outside the top k, and outside the smallest set covering top_p of
    the probability, set to -inf."""
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already cover top_p of the mass
        drop = probs.cumsum(-1) - probs > top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def check_length(prompts: list[list[int]], max_new_tokens: int, context: int) -> None:
    """The prompts and their answers fit the model's context (ConfigError on max_new_tokens or the prompt)."""
    longest = max(len(p) for p in prompts)
    if longest >= context:
        raise ConfigError(f"the longest prompt has {longest} tokens and fills the model's {context}-position "
                          f"context, leaving no room for an answer; shorten it", "prompt", f"({longest} tokens)")
    if max_new_tokens < 1 or longest + max_new_tokens > context:
        raise ConfigError(f"must be between 1 and {context - longest} (what the model's {context}-position "
                          f"context leaves after a {longest}-token prompt)", "max_new_tokens", max_new_tokens)


@torch.inference_mode()
def generate(model, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = Sampling(),
             stop: Callable[[int, list[int]], bool] | None = None) -> Iterator[torch.Tensor]:
    """Yield each step's next ids, (batch,), FINISHED for rows already stopped, until every row
    has stopped or has max_new_tokens. The model may be tensor-parallel: every rank runs this
    loop with the same seed and draws the same tokens."""
    model.eval()
    check_length(prompts, max_new_tokens, model.cfg.max_seq_len)
    device = next(model.parameters()).device
    ids, pad = left_pad(prompts)
    sampler = Sampler(prompts, model.cfg.vocab_size, max_new_tokens, sampling, stop)
    cache = KVCache(model, len(prompts), ids.shape[1] + max_new_tokens, pad.to(device))
    logits = model(ids.to(device), cache=cache, last_only=True)[:, -1]
    while True:
        next_ids = sampler.choose(logits)
        yield next_ids
        if sampler.done:
            return
        logits = model(next_ids.clamp(min=0)[:, None].to(device), cache=cache, last_only=True)[:, -1]
