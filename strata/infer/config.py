"""What `strata generate` is asked to do, typed: the engine (strata/infer/session.py) takes a
GenerateConfig, never the command line's namespace, and the command line
(strata/cli/generate.py) builds one from its flags. `problems()` checks the settings alone; what
depends on the checkpoint (the model against tp/pp/ep, the prompts against the vocabulary and the
context) is checked when the requests are prepared (session.prepare_requests)."""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.infer.generate import Sampling


@dataclass(frozen=True)
class GenerateConfig:
    checkpoint: str  # a checkpoint directory, or a save directory (its latest)
    prompts: tuple[str, ...] | None = None  # texts (the checkpoint's tokenizer encodes them) ...
    prompt_ids: tuple[str, ...] | None = None  # ... or comma-separated token ids, one request each
    max_new_tokens: int | None = None  # None: 100, or what the context leaves
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()  # texts that end an answer (besides the model's end-of-text)
    tp: int = 1
    pp: int = 1
    ep: int = 1
    nproc: int | None = None  # None: tp x pp x ep
    micro_batches: int | None = None  # with pp: requests in flight, in groups (None: min(pp, prompts))
    dtype: str | None = None  # None: the checkpoint's
    device: str = "cpu"
    timeout: float = 300.0  # seconds a collective may take
    timing: bool = False  # print time to the first token and tokens/s to stderr

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.ep

    @property
    def requests(self) -> int:
        return len(self.prompts or self.prompt_ids or ())

    def problems(self) -> list[str]:
        """What is wrong with these settings alone, one line each, in the flags' words."""
        checks = [(self.tp >= 1, f"--tp {self.tp}: must be >= 1"), (self.pp >= 1, f"--pp {self.pp}: must be >= 1"),
                  (self.ep >= 1, f"--ep {self.ep}: must be >= 1"),
                  (self.ep == 1 or self.pp == 1, f"--ep {self.ep}: not with --pp {self.pp} in generation"),
                  (self.max_new_tokens is None or self.max_new_tokens >= 1,
                   f"--max-new-tokens {self.max_new_tokens}: must be >= 1"),
                  (self.micro_batches is None or self.pp > 1,
                   "--micro-batches: only with --pp (requests in flight through the pipeline stages)"),
                  (self.micro_batches is None or 1 <= self.micro_batches <= self.requests,
                   f"--micro-batches {self.micro_batches}: must be between 1 and the {self.requests} prompts"),
                  (0 < self.timeout < float("inf"), f"--timeout {self.timeout}: must be > 0 seconds"),
                  (all(self.stop), "--stop '': an empty stop string would end every answer at once")]
        return [message for ok, message in checks if not ok] + self.sampling.problems()
