"""`strata bench generate`: how latency grows with the answer's length.

For each prompt, answer length and batch size, generate exactly that many tokens R times (no stop
strings, no end-of-text), timing the whole answer, the first token (prefill + one sample) and the
tokens after it. With --compare, transformers' `generate` runs the same weights (written as a
Hugging Face model directory, as `strata convert --to-hf` does) on the same prompts, alternating
run by run with strata so that a noisy machine slows both alike. A least-squares line of latency
against answer length, per engine and batch, says what a token (and 100 characters) costs."""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from strata.checkpoint.hf import save_hf
from strata.checkpoint.store import verified_file
from strata.errors import ConfigError
from strata.infer.generate import Sampling, check_length, generate
from strata.infer.session import load_for_inference, parse_prompt_ids
from strata.model.presets import PRESETS
from strata.model.transformer import build_model
from strata.rules.dtypes import torch_dtype

DEFAULT_TEXT_PROMPTS = ["ROMEO:", "To be, or not to be, that is the question:"]
DEFAULT_ID_PROMPT_LENGTHS = (4, 32)


@dataclass(frozen=True)
class GenerateBenchConfig:
    """What `strata bench generate` times, typed (strata/cli/tools.generate_bench_config builds it
    from the flags and checks them): the weights (a checkpoint, or a preset with random weights),
    the prompts (texts, or token ids as given; None: the defaults), the answer lengths and batch
    sizes, runs of each, and what to compare, print and draw."""
    checkpoint: str | None = None
    model: str | None = None
    prompt: tuple[str, ...] | None = None
    prompt_ids: tuple[str, ...] | None = None
    lengths: tuple[int, ...] = (16, 32, 64, 128)
    batches: tuple[int, ...] = (1,)
    runs: int = 3
    compare: bool = False
    plot: str | None = None
    json: bool = False
    dtype: str | None = None
    device: str = "cpu"
    threads: int | None = None


@dataclass
class Run:
    engine: str
    batch: int
    prompt: str
    tokens: int  # answer tokens per request
    chars: int | None  # the first request's answer, decoded (None without a tokenizer)
    latency: float  # seconds for the whole batch's answers
    ttft: float  # seconds to the first token

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first."""
        return (self.latency - self.ttft) / max(self.tokens - 1, 1)


@dataclass
class Fit:
    engine: str
    batch: int
    per_token: float  # seconds per answer token (the slope)
    fixed: float  # seconds (the intercept: prefill and set-up)
    r2: float
    per_100_chars: float | None  # the slope of latency against characters, x 100


def time_strata(model, prompt: list[int], batch: int, tokens: int) -> tuple[float, float, list[int]]:
    """(latency, time to first token, the first request's answer)."""
    answer, first = [], None
    start = time.perf_counter()
    for next_ids in generate(model, [prompt] * batch, tokens, Sampling()):
        if first is None:
            first = time.perf_counter()
        answer.append(int(next_ids[0]))
    return time.perf_counter() - start, first - start, answer


class _FirstTokenClock:
    """A transformers streamer that notes when the first generated token arrives (its first
    put() is the prompt)."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def time_transformers(hf_model, prompt: list[int], batch: int, tokens: int) -> tuple[float, float, list[int]]:
    ids = torch.tensor([prompt] * batch, device=hf_model.device)
    clock = _FirstTokenClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                min_new_tokens=tokens, do_sample=False, streamer=clock, pad_token_id=0)
    latency = time.perf_counter() - start
    return latency, clock.first - start, out[0, len(prompt):].tolist()


def load_transformers(model, tokenizer_file: str | None, directory: str):
    """The same weights as transformers' AutoModelForCausalLM (through a Hugging Face directory)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    tensors = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    save_hf(tensors, model.cfg, directory, None, tokenizer_file)
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()


def least_squares(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """(slope, intercept, R²) of y = slope x + intercept."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx if sxx else 0.0
    intercept = my - slope * mx
    total = sum((y - my) ** 2 for y in ys)
    residual = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys))
    return slope, intercept, 1 - residual / total if total else 1.0


def fits(runs: list[Run]) -> list[Fit]:
    """A line per engine and batch, where the answers came in two lengths or more."""
    out = []
    for engine, batch in dict.fromkeys((r.engine, r.batch) for r in runs):
        mine = [r for r in runs if (r.engine, r.batch) == (engine, batch)]
        if len({r.tokens for r in mine}) < 2:
            continue
        slope, intercept, r2 = least_squares([r.tokens for r in mine], [r.latency for r in mine])
        per_100 = None
        if all(r.chars for r in mine) and len({r.chars for r in mine}) > 1:
            per_100 = 100 * least_squares([r.chars for r in mine], [r.latency for r in mine])[0]
        out.append(Fit(engine, batch, slope, intercept, r2, per_100))
    return out


def table(runs: list[Run]) -> list[dict]:
    """One row per (engine, batch, prompt, length): the means over its runs."""
    rows = []
    for key in dict.fromkeys((r.engine, r.batch, r.prompt, r.tokens) for r in runs):
        mine = [r for r in runs if (r.engine, r.batch, r.prompt, r.tokens) == key]
        mean = lambda values: sum(values) / len(values)  # noqa: E731
        latency, ttft, tpot = mean([r.latency for r in mine]), mean([r.ttft for r in mine]), mean([r.tpot for r in mine])
        chars = mean([r.chars for r in mine]) if all(r.chars is not None for r in mine) else None
        rows.append({"engine": key[0], "batch": key[1], "prompt": key[2], "runs": len(mine), "tokens": key[3],
                     "chars": chars, "latency_s": latency, "ttft_s": ttft, "tpot_ms": 1000 * tpot,
                     "decode_tokens_per_s": key[1] / tpot, "s_per_100_chars": 100 * latency / chars if chars else None})
    return rows


def print_report(rows: list[dict], fitted: list[Fit]) -> None:
    header = (f"{'engine':<13}{'batch':>6}  {'prompt':<24}{'runs':>5}{'tokens':>7}{'chars':>7}{'latency s':>11}"
              f"{'TTFT s':>9}{'TPOT ms':>9}{'decode tok/s':>14}{'s/100 chars':>13}")
    print(header)
    for r in rows:
        prompt = r["prompt"] if len(r["prompt"]) <= 22 else r["prompt"][:21] + "…"
        chars = f"{r['chars']:.0f}" if r["chars"] is not None else "-"
        per_100 = f"{r['s_per_100_chars']:.3f}" if r["s_per_100_chars"] is not None else "-"
        print(f"{r['engine']:<13}{r['batch']:>6}  {prompt:<24}{r['runs']:>5}{r['tokens']:>7}{chars:>7}"
              f"{r['latency_s']:>11.3f}{r['ttft_s']:>9.3f}{r['tpot_ms']:>9.2f}{r['decode_tokens_per_s']:>14.1f}{per_100:>13}")
    print()
    if not fitted:
        print("(no fitted line: it needs answers of two lengths or more, --lengths 16,32,...)")
    for f in fitted:
        chars = f"; {f.per_100_chars:.3f} s per 100 characters" if f.per_100_chars is not None else ""
        print(f"{f.engine} batch {f.batch}: latency = {f.fixed:.3f} s + {1000 * f.per_token:.2f} ms x answer tokens "
              f"(R² {f.r2:.4f}){chars}")
    engines = sorted({r["engine"] for r in rows})
    if len(engines) == 2:
        for batch in sorted({r["batch"] for r in rows}):
            speed = {e: _mean_decode(rows, e, batch) for e in engines}
            print(f"batch {batch}: decode tokens/s strata {speed['strata']:.1f}, transformers "
                  f"{speed['transformers']:.1f} (strata/transformers {speed['strata'] / speed['transformers']:.2f})")


def _mean_decode(rows: list[dict], engine: str, batch: int) -> float:
    """Answer tokens over decode seconds, summed over the rows (the longer answers weigh more)."""
    mine = [r for r in rows if r["engine"] == engine and r["batch"] == batch]
    return sum(r["batch"] * (r["tokens"] - 1) for r in mine) / sum((r["latency_s"] - r["ttft_s"]) for r in mine)


def plot(runs: list[Run], fitted: list[Fit], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for f in fitted:
        mine = [r for r in runs if (r.engine, r.batch) == (f.engine, f.batch)]
        xs = [r.tokens for r in mine]
        points = ax.scatter(xs, [r.latency for r in mine], s=12, alpha=0.6)
        line = [0, max(xs)]
        ax.plot(line, [f.fixed + f.per_token * x for x in line], color=points.get_facecolor()[0],
                label=f"{f.engine}, batch {f.batch}: {1000 * f.per_token:.1f} ms/token, R² {f.r2:.3f}")
    ax.set_xlabel("answer length (tokens)")
    ax.set_ylabel("latency (s)")
    ax.set_title("generation latency against answer length")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_bench(config: GenerateBenchConfig) -> int:
    lengths, batches = config.lengths, config.batches
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    tokenizer, tokenizer_file = None, None
    dtype = torch_dtype(config.dtype) if config.dtype else None
    if config.checkpoint:
        model, tokenizer = load_for_inference(config.checkpoint, config.device, dtype=dtype)
        tokenizer_file = verified_file(config.checkpoint, "tokenizer.json")
    else:
        if config.model not in PRESETS:
            raise ConfigError(f"--model {config.model}: unknown preset; valid: {', '.join(PRESETS)}")
        model = build_model(PRESETS[config.model], config.device, dtype or torch.float32, seed=0).eval()
    prompts = _prompts(config, tokenizer, model.cfg.vocab_size)
    try:
        check_length(list(prompts.values()), max(lengths), model.cfg.max_seq_len)
    except ConfigError as e:  # here the answer lengths are --lengths
        raise ConfigError(e.reason, "lengths" if e.field == "max_new_tokens" else e.field, e.value) from None

    engines = {"strata": lambda p, b, n: time_strata(model, p, b, n)}
    with tempfile.TemporaryDirectory() as hf_dir:
        if config.compare:
            hf_model = load_transformers(model, tokenizer_file if tokenizer else None, hf_dir)
            engines["transformers"] = lambda p, b, n: time_transformers(hf_model, p, b, n)
        first_prompt = next(iter(prompts.values()))
        for timer in engines.values():  # warm-up: first calls pay for allocation and kernel choice
            timer(first_prompt, max(batches), 4)
        runs, same = [], True
        for batch in batches:
            for name, prompt in prompts.items():
                for tokens in lengths:
                    for _ in range(config.runs):
                        answers = []
                        for engine, timer in engines.items():  # alternate: noise hits both alike
                            latency, ttft, answer = timer(prompt, batch, tokens)
                            chars = len(tokenizer.decode(answer)) if tokenizer is not None else None
                            runs.append(Run(engine, batch, name, len(answer), chars, latency, ttft))
                            answers.append(answer)
                        same &= all(a == answers[0] for a in answers)
    rows, fitted = table(runs), fits(runs)
    if config.json:
        print(json.dumps({"rows": rows, "fits": [asdict(f) for f in fitted], "same_answers": same,
                          "runs": [asdict(r) for r in runs]}, indent=1))
    else:
        print_report(rows, fitted)
        if config.compare:
            print(f"greedy answers {'identical' if same else 'DIFFER'} between the engines")
    if config.plot:
        plot(runs, fitted, config.plot)
        if not config.json:
            print(f"wrote {config.plot}")
    return 0


def _prompts(config: GenerateBenchConfig, tokenizer, vocab: int) -> dict[str, list[int]]:
    """name -> token ids."""
    if config.prompt:
        if tokenizer is None:
            raise ConfigError("--prompt: no tokenizer (a --model preset, or a checkpoint without tokenizer.json); "
                              "use --prompt-ids")
        return {text: tokenizer.encode(text).ids for text in config.prompt}
    if config.prompt_ids:
        return {f"ids x{len(ids)}: {given}": ids
                for given in config.prompt_ids for ids in [parse_prompt_ids(given, vocab)]}
    if tokenizer is not None:
        return {text: tokenizer.encode(text).ids for text in DEFAULT_TEXT_PROMPTS}
    generator = torch.Generator().manual_seed(0)
    return {f"{n} random ids": torch.randint(1, vocab, (n,), generator=generator).tolist()
            for n in DEFAULT_ID_PROMPT_LENGTHS}
