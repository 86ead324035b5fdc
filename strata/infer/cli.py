"""`strata generate`: load a checkpoint (whole, tensor-parallel, or one pipeline stage per rank),
encode the prompts, and stream the answers."""

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
from strata.distributed.launch import launch_local
from strata.distributed.mesh import ParallelDims, expert_axes, init_distributed, pick_device, pipeline_links
from strata.errors import ConfigError, CorruptError
from strata.infer.generate import FINISHED, Sampling, check_length, generate
from strata.infer.pipeline import generate_pipelined
from strata.model.transformer import build_model
from strata.parallel.expert import ExpertAxes, apply_expert_parallel, slice_experts
from strata.parallel.pipeline.stage import keep_stage
from strata.parallel.tensor import apply_tensor_parallel, shard_specs, slice_tensor_parallel
from strata.rules.devices import check_device
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


def run_generate(args, argv: list[str]) -> int:
    """Generate on one process, or on tp x pp processes (started here unless torchrun did)."""
    _check_flags(args)
    check_device(args.device)
    world = args.tp * args.pp * args.ep
    if args.nproc is not None and args.nproc != world:
        sizes = (("tp", args.tp), ("pp", args.pp)) + ((("ep", args.ep),) if args.ep > 1 else ())
        raise ConfigError(f"--nproc {args.nproc}: generation runs on {' x '.join(n for n, _ in sizes)} = "
                          f"{' x '.join(str(v) for _, v in sizes)} = {world} processes; set --nproc {world}")
    launched = "LOCAL_RANK" in os.environ
    if world > 1 and not launched:
        _requests(args)  # every check that can fail on input, once, before any process starts
        store.check_checkpoint(args.checkpoint)  # its files too: every checksum, every shard's header
        return launch_local(world, argv)
    if not launched or int(os.environ.get("WORLD_SIZE", 1)) == 1:
        return _generate(args, _requests(args), tp_group=None, stage=None, links=None, experts=None)
    _, size, _ = init_distributed(pick_device(args.device), timeout_s=args.timeout)
    try:
        if size != world:
            raise ConfigError(f"--tp {args.tp} x --pp {args.pp} x --ep {args.ep}: launched with {size} processes; "
                              f"they must be equal")
        dims = ParallelDims(dp=args.ep, tp=args.tp, pp=args.pp)  # the expert-parallel ranks run the same requests
        mesh = dims.build_mesh(pick_device(args.device).type)
        where = dims.coordinates(dist.get_rank())
        tp_group = mesh["tp"].get_group() if args.tp > 1 else None
        requests, stage, links = _requests(args), None, None
        if args.pp > 1:
            stage = (requests.layout, where["pp"])
            links = pipeline_links(dims, dist.get_rank(), wraps=False, timeout_s=args.timeout,
                                   kinds=("activation", "control"))
        experts = ExpertAxes(*expert_axes(dims, args.ep, dist.get_rank(), args.timeout)) if args.ep > 1 else None
        return _generate(args, requests, tp_group, stage, links, experts)
    finally:
        comm.close_streams()
        dist.destroy_process_group()


def _check_flags(args) -> None:
    requests = len(args.prompt or args.prompt_ids)
    checks = [(args.tp >= 1, f"--tp {args.tp}: must be >= 1"), (args.pp >= 1, f"--pp {args.pp}: must be >= 1"),
              (args.ep >= 1, f"--ep {args.ep}: must be >= 1"),
              (args.ep == 1 or args.pp == 1, f"--ep {args.ep}: not with --pp {args.pp} in generation"),
              (args.max_new_tokens is None or args.max_new_tokens >= 1,
               f"--max-new-tokens {args.max_new_tokens}: must be >= 1"),
              (args.micro_batches is None or args.pp > 1,
               "--micro-batches: only with --pp (requests in flight through the pipeline stages)"),
              (args.micro_batches is None or 1 <= args.micro_batches <= requests,
               f"--micro-batches {args.micro_batches}: must be between 1 and the {requests} prompts"),
              (0 < args.timeout < float("inf"), f"--timeout {args.timeout}: must be > 0 seconds"),
              (all(args.stop), "--stop '': an empty stop string would end every answer at once")]
    problems = [message for ok, message in checks if not ok] + _sampling(args).problems()
    if problems:
        raise ConfigError(problems[0])


def _sampling(args) -> Sampling:
    return Sampling(args.temperature, args.top_k, args.top_p, args.repetition_penalty, args.seed)


@dataclass
class Requests:
    """What the command line asks for, checked against the checkpoint."""
    prompts: list[list[int]]
    texts: list[str]  # what to print for each prompt
    tokenizer: object
    stops: StopStrings | None
    layout: object  # the pipeline layout with --pp, else None


def _requests(args) -> Requests:
    """Read the checkpoint's model config and tokenizer, encode the prompts, and check everything
    that depends on them (tp and pp against the model, ids against the vocabulary, the answer
    against the context). Sets the default --max-new-tokens."""
    if not os.path.isdir(args.checkpoint):
        raise ConfigError(f"--checkpoint {args.checkpoint}: no such directory")
    path = store.resolve(args.checkpoint)
    state = store.read_state(path)
    cfg = store.model_config(state, path)
    check_tensor_parallel(cfg, args.tp)
    check_experts(cfg, args.ep, args.ep, 0, "1d", False, None)  # the ep ranks run the same requests: dp = ep
    layout = None
    if args.pp > 1:
        layout = make_layout(cfg, args.pp, 1, cfg.max_seq_len)
    tokenizer = _tokenizer(path)
    prompts, texts = _encode_prompts(args, tokenizer, cfg.vocab_size)
    if args.max_new_tokens is None:
        args.max_new_tokens = max(min(100, cfg.max_seq_len - max(map(len, prompts))), 1)
    check_length(prompts, args.max_new_tokens, cfg.max_seq_len)
    stops = None
    if tokenizer is not None:
        stops = StopStrings(tokenizer, args.stop, end_of_text_ids(state, tokenizer))
    elif args.stop:
        raise ConfigError(f"--stop {args.stop[0]!r}: the checkpoint has no tokenizer.json to find text with")
    return Requests(prompts, texts, tokenizer, stops, layout)


def end_of_text_ids(state: dict, tokenizer) -> frozenset[int]:
    """The ids that end an answer: a converted model's EOS (its config.json's eos_token_id, one id
    or a list: Llama 3.1 Instruct ends turns with three), and strata's <|endoftext|> when the
    vocabulary has it."""
    eos = ((state.get("hf") or {}).get("config") or {}).get("eos_token_id")
    ids = [*(eos if isinstance(eos, list) else [eos]), tokenizer.token_to_id(END_OF_TEXT)]
    return frozenset(i for i in ids if isinstance(i, int) and not isinstance(i, bool))


def _generate(args, requests: Requests, tp_group, stage, links, experts) -> int:
    sampling = _sampling(args)
    prompts, texts, tokenizer, stops = requests.prompts, requests.texts, requests.tokenizer, requests.stops
    model, _ = load_for_inference(args.checkpoint, pick_device(args.device), tp_group, stage,
                                  torch_dtype(args.dtype) if args.dtype else None, experts)

    pp_rank, pp = (stage[1], args.pp) if stage is not None else (0, 1)
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    ep_rank = experts.ep.rank if experts is not None else 0
    # whoever samples prints: the last stage's first tp rank (of the first expert-parallel rank)
    printing = pp_rank == pp - 1 and tp_rank == 0 and ep_rank == 0
    printer = Printer(texts, tokenizer, stops, sys.stdout if printing else io.StringIO())
    if stage is None:
        steps = ((range(len(prompts)), ids) for ids in generate(model, prompts, args.max_new_tokens, sampling, stops))
    else:
        micro_batches = args.micro_batches or min(pp, len(prompts))
        steps = generate_pipelined(model, prompts, args.max_new_tokens, sampling, stops, micro_batches, pp_rank, pp, links)
    started, first = time.perf_counter(), None
    for rows, next_ids in steps:
        first = first or time.perf_counter()
        printer.add(rows, next_ids)
    printer.finish()
    if args.timing and printing:
        seconds, tokens = time.perf_counter() - started, sum(map(len, printer.answers))
        print(f"{len(prompts)} request(s), {tokens} answer tokens in {seconds:.3f} s: first token after "
              f"{first - started:.3f} s, {tokens / seconds:.1f} tokens/s", file=sys.stderr)
    return 0


def _encode_prompts(args, tokenizer, vocab: int) -> tuple[list[list[int]], list[str]]:
    """(token ids, text to print) per request."""
    if args.prompt is None:
        prompts = [parse_prompt_ids(given, vocab) for given in args.prompt_ids]
        return prompts, [" ".join(map(str, p)) for p in prompts]
    if tokenizer is None:
        raise ConfigError(f"--prompt: checkpoint {args.checkpoint} has no tokenizer.json "
                          f"(trained on synthetic data); use --prompt-ids 1,2,3")
    prompts = [tokenizer.encode(p).ids for p in args.prompt]
    if not all(prompts):
        raise ConfigError("--prompt '': a prompt must encode to at least one token")
    return prompts, list(args.prompt)


def parse_prompt_ids(given: str, vocab: int) -> list[int]:
    """'1,2,3' -> [1, 2, 3], each id checked against the vocabulary."""
    try:
        ids = [int(x) for x in given.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--prompt-ids {given}: want comma-separated integers") from None
    if not ids or any(not 0 <= i < vocab for i in ids):
        raise ConfigError(f"prompt ids {ids[:8]}: want at least one id, each in [0, {vocab})")
    return ids
