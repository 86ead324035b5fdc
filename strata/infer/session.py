"""Generation as `strata generate` runs it (the command line: strata/cli/generate.py): load a
checkpoint (whole, tensor-parallel, or one pipeline stage per rank), encode the prompts, and
stream the answers, on this process or on the ranks torchrun started, from a GenerateConfig."""

from __future__ import annotations

import io
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from strata.checkpoint import store
from strata.checkpoint.shards import read_full
from strata.data.tokenizer import END_OF_TEXT, read_tokenizer
from strata.distributed import comm
from strata.distributed.mesh import ParallelDims, expert_axes, init_distributed, pick_device, pipeline_links
from strata.errors import ConfigError, CorruptError
from strata.infer.config import GenerateConfig
from strata.infer.generate import FINISHED, check_length, generate
from strata.infer.pipeline import generate_pipelined
from strata.model.transformer import build_model
from strata.parallel.expert import ExpertAxes, apply_expert_parallel, slice_experts
from strata.parallel.pipeline.stage import keep_stage
from strata.parallel.tensor import apply_tensor_parallel, shard_specs, slice_tensor_parallel
from strata.rules.dtypes import torch_dtype
from strata.rules.experts import check_experts
from strata.rules.layout import check_tensor_parallel
from strata.rules.pipeline_cut import make_layout


def load_for_inference(checkpoint: str, device="cpu", tp_group=None, stage=None, dtype=None, experts=None):
    """(model, tokenizer or None) from a checkpoint directory or a save directory. With a tp
    group, every layer is split across its ranks; with stage = (pipeline layout, pp rank), only
    that stage's layers are built and read; with experts (ExpertAxes), a mixture's experts are
    split over the expert-parallel group."""
    if not os.path.isdir(checkpoint):
        raise ConfigError(f"--checkpoint {checkpoint}: no such directory")
    path, state, reader = store.open_checkpoint(checkpoint)
    model_cfg = store.checked_model_config(path, state, reader)  # before a model is built from it
    if dtype is None:
        dtype = torch.float64 if (state.get("config") or {}).get("dtype") == "fp64" else torch.float32
    model = build_model(model_cfg, seed=None)
    if tp_group is not None:  # before the stage is cut, as training does (on the meta device: free)
        check_tensor_parallel(model_cfg, dist.get_world_size(tp_group))
        apply_tensor_parallel(model, tp_group)
    if experts is not None:
        check_experts(model_cfg, experts.ep.size, experts.ep.size, 0, "1d", False, None)
        apply_expert_parallel(model, experts)
    if stage is not None:
        keep_stage(model, *stage)
    model = model.to_empty(device=device).to(dtype)
    with reader:
        tensors = read_full(reader, model.state_dict().keys())
    if tp_group is not None:
        tensors = slice_tensor_parallel(tensors, shard_specs(model), tp_group)
    if experts is not None:
        tensors = slice_experts(tensors, shard_specs(model))
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ConfigError(f"checkpoint {path}: does not match its model config "
                          f"(missing {list(missing)[:3]}, unexpected {list(unexpected)[:3]})")
    model.reset_buffers()
    return model, _tokenizer(path)


def _tokenizer(checkpoint_path: str):
    """The tokenizer saved with a checkpoint, or None (a model trained on synthetic data)."""
    tokenizer_file = store.verified_file(checkpoint_path, "tokenizer.json")
    if tokenizer_file is None:
        return None
    return read_tokenizer(tokenizer_file, f"checkpoint {checkpoint_path}: tokenizer.json", CorruptError)


class StopStrings:
    """stop(row, answer ids): the answer's text contains a stop string, or its last token is an
    end-of-text token (one id, several, or None). Decodes only the answer's tail: enough tokens for
    the longest stop string."""

    def __init__(self, tokenizer, stops: list[str], end_of_text: int | Iterable[int] | None):
        self.tokenizer, self.stops = tokenizer, stops
        self.end_of_text = frozenset([end_of_text] if isinstance(end_of_text, int) else end_of_text or ())
        self.tail = 4 * max((len(s) for s in stops), default=0) + 2  # a character is at most 4 bytes

    def __call__(self, row: int, answer: list[int]) -> bool:
        if answer[-1] in self.end_of_text:
            return True
        if not self.stops:
            return False
        text = self.tokenizer.decode(answer[-self.tail:])
        return any(s in text for s in self.stops)

    def cut(self, answer: list[int]) -> str:
        """The answer's text, up to its first stop string or its end-of-text token."""
        ends = [i for i, token in enumerate(answer) if token in self.end_of_text]
        if ends:
            answer = answer[:ends[0]]
        text = self.tokenizer.decode(answer)
        for s in self.stops:
            if s in text:
                text = text[:text.index(s)]
        return text


class Printer:
    """Writes answers as they grow: a single request streams token by token (holding back text
    that may be the start of a stop string, and half a multi-byte character); a batch prints each
    request, prompt and answer, once all have finished."""

    def __init__(self, prompts_text: list[str], tokenizer, stops: StopStrings | None, out):
        self.prompts, self.tokenizer, self.stops, self.out = prompts_text, tokenizer, stops, out
        self.answers: list[list[int]] = [[] for _ in prompts_text]
        self.printed = ""
        if len(prompts_text) == 1:
            self.out.write(prompts_text[0])

    def add(self, rows: range, next_ids: torch.Tensor) -> None:
        for row, token in zip(rows, next_ids.tolist()):
            if token != FINISHED:
                self.answers[row].append(token)
        if len(self.prompts) == 1:
            self._stream()

    def _text(self, row: int) -> str:
        if self.tokenizer is None:
            return "".join(f" {t}" for t in self.answers[row])
        return self.stops.cut(self.answers[row])

    def _stream(self) -> None:
        text = self._text(0)
        if self.tokenizer is not None:
            text = text.rstrip("\ufffd")  # a character split across tokens: wait for the rest
            for s in self.stops.stops:  # hold back what may be the start of a stop string
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:k]):
                        text = text[:-k]
                        break
        if len(text) > len(self.printed):
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text

    def finish(self) -> None:
        if len(self.prompts) == 1:
            rest = self._text(0)
            self.out.write(rest[len(self.printed):] + "\n")
        else:
            for row, prompt in enumerate(self.prompts):
                self.out.write(prompt + self._text(row) + "\n")
        self.out.flush()


def generate_on_ranks(cfg: GenerateConfig) -> int:
    """Generate on the tp x pp x ep ranks torchrun started (this process is one of them): the
    mesh's groups and links made, each rank loads its part and the last stage prints."""
    _, size, _ = init_distributed(pick_device(cfg.device), timeout_s=cfg.timeout)
    try:
        if size != cfg.world_size:
            raise ConfigError(f"--tp {cfg.tp} x --pp {cfg.pp} x --ep {cfg.ep}: launched with {size} processes; "
                              f"they must be equal")
        dims = ParallelDims(dp=cfg.ep, tp=cfg.tp, pp=cfg.pp)  # the expert-parallel ranks run the same requests
        mesh = dims.build_mesh(pick_device(cfg.device).type)
        where = dims.coordinates(dist.get_rank())
        tp_group = mesh["tp"].get_group() if cfg.tp > 1 else None
        requests, stage, links = prepare_requests(cfg), None, None
        if cfg.pp > 1:
            stage = (requests.layout, where["pp"])
            links = pipeline_links(dims, dist.get_rank(), wraps=False, timeout_s=cfg.timeout,
                                   kinds=("activation", "control"))
        experts = ExpertAxes(*expert_axes(dims, cfg.ep, dist.get_rank(), cfg.timeout)) if cfg.ep > 1 else None
        return generate_here(cfg, requests, tp_group, stage, links, experts)
    finally:
        comm.close_streams()
        dist.destroy_process_group()


@dataclass(frozen=True)
class Requests:
    """What the config asks for, checked against the checkpoint."""
    prompts: list[list[int]]
    texts: list[str]  # what to print for each prompt
    tokenizer: object
    stops: StopStrings | None
    layout: object  # the pipeline layout with --pp, else None
    max_new_tokens: int  # as given, or 100, or what the context leaves


def prepare_requests(cfg: GenerateConfig) -> Requests:
    """Read the checkpoint's model config and tokenizer, encode the prompts, and check everything
    that depends on them (tp and pp against the model, ids against the vocabulary, the answer
    against the context)."""
    if not os.path.isdir(cfg.checkpoint):
        raise ConfigError(f"--checkpoint {cfg.checkpoint}: no such directory")
    path = store.resolve(cfg.checkpoint)
    state = store.read_state(path)
    model = store.model_config(state, path)
    check_tensor_parallel(model, cfg.tp)
    check_experts(model, cfg.ep, cfg.ep, 0, "1d", False, None)  # the ep ranks run the same requests: dp = ep
    layout = None
    if cfg.pp > 1:
        layout = make_layout(model, cfg.pp, 1, model.max_seq_len)
    tokenizer = _tokenizer(path)
    prompts, texts = _encode_prompts(cfg, tokenizer, model.vocab_size)
    max_new_tokens = cfg.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = max(min(100, model.max_seq_len - max(map(len, prompts))), 1)
    check_length(prompts, max_new_tokens, model.max_seq_len)
    stops = None
    if tokenizer is not None:
        stops = StopStrings(tokenizer, list(cfg.stop), end_of_text_ids(state, tokenizer))
    elif cfg.stop:
        raise ConfigError(f"--stop {cfg.stop[0]!r}: the checkpoint has no tokenizer.json to find text with")
    return Requests(prompts, texts, tokenizer, stops, layout, max_new_tokens)


def end_of_text_ids(state: dict, tokenizer) -> frozenset[int]:
    """The ids that end an answer: a converted model's EOS (its config.json's eos_token_id, one id
    or a list: Llama 3.1 Instruct ends turns with three), and strata's <|endoftext|> when the
    vocabulary has it."""
    eos = ((state.get("hf") or {}).get("config") or {}).get("eos_token_id")
    ids = [*(eos if isinstance(eos, list) else [eos]), tokenizer.token_to_id(END_OF_TEXT)]
    return frozenset(i for i in ids if isinstance(i, int) and not isinstance(i, bool))


def generate_here(cfg: GenerateConfig, requests: Requests, tp_group=None, stage=None, links=None,
                  experts=None) -> int:
    """Generate on this process: the whole model, or its part on a rank (tp_group, stage: (the
    pipeline layout, this rank's stage), links, experts); the rank that samples prints."""
    sampling, new_tokens = cfg.sampling, requests.max_new_tokens
    prompts, texts, tokenizer, stops = requests.prompts, requests.texts, requests.tokenizer, requests.stops
    model, _ = load_for_inference(cfg.checkpoint, pick_device(cfg.device), tp_group, stage,
                                  torch_dtype(cfg.dtype) if cfg.dtype else None, experts)

    pp_rank, pp = (stage[1], cfg.pp) if stage is not None else (0, 1)
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    ep_rank = experts.ep.rank if experts is not None else 0
    # whoever samples prints: the last stage's first tp rank (of the first expert-parallel rank)
    printing = pp_rank == pp - 1 and tp_rank == 0 and ep_rank == 0
    printer = Printer(texts, tokenizer, stops, sys.stdout if printing else io.StringIO())
    if stage is None:
        steps = ((range(len(prompts)), ids) for ids in generate(model, prompts, new_tokens, sampling, stops))
    else:
        micro_batches = cfg.micro_batches or min(pp, len(prompts))
        steps = generate_pipelined(model, prompts, new_tokens, sampling, stops, micro_batches, pp_rank, pp, links)
    started, first = time.perf_counter(), None
    for rows, next_ids in steps:
        first = first or time.perf_counter()
        printer.add(rows, next_ids)
    printer.finish()
    if cfg.timing and printing:
        seconds, tokens = time.perf_counter() - started, sum(map(len, printer.answers))
        print(f"{len(prompts)} request(s), {tokens} answer tokens in {seconds:.3f} s: first token after "
              f"{first - started:.3f} s, {tokens / seconds:.1f} tokens/s", file=sys.stderr)
    return 0


def _encode_prompts(cfg: GenerateConfig, tokenizer, vocab: int) -> tuple[list[list[int]], list[str]]:
    """(token ids, text to print) per request."""
    if cfg.prompts is None:
        prompts = [parse_prompt_ids(given, vocab) for given in cfg.prompt_ids or ()]
        return prompts, [" ".join(map(str, p)) for p in prompts]
    if tokenizer is None:
        raise ConfigError(f"--prompt: checkpoint {cfg.checkpoint} has no tokenizer.json "
                          f"(trained on synthetic data); use --prompt-ids 1,2,3")
    prompts = [tokenizer.encode(p).ids for p in cfg.prompts]
    if not all(prompts):
        raise ConfigError("--prompt '': a prompt must encode to at least one token")
    return prompts, list(cfg.prompts)


def parse_prompt_ids(given: str, vocab: int) -> list[int]:
    """'1,2,3' -> [1, 2, 3], each id checked against the vocabulary."""
    try:
        ids = [int(x) for x in given.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--prompt-ids {given}: want comma-separated integers") from None
    if not ids or any(not 0 <= i < vocab for i in ids):
        raise ConfigError(f"prompt ids {ids[:8]}: want at least one id, each in [0, {vocab})")
    return ids
