"""The flags of `strata generate` and `strata bench generate` (kept apart from the engine so that
parsing the command line does not import torch)."""

from __future__ import annotations

DTYPE_NAMES = ("fp32", "fp64", "bf16", "fp16")


def add_flags(gen) -> None:
    gen.add_argument("--checkpoint", required=True, help="a checkpoint directory, or a save directory (its latest)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", help="text (needs the tokenizer saved with the checkpoint); "
                                                          "repeat for a batch of requests")
    prompt.add_argument("--prompt-ids", action="append", help="comma-separated token ids, e.g. 1,2,3; repeat for a batch")
    gen.add_argument("--max-new-tokens", type=int,
                     help="answer tokens at most (default: 100, or what the model's context leaves)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeating tokens (CTRL's)")
    gen.add_argument("--stop", action="append", default=[], help="stop an answer at this text (repeatable); "
                                                                 "answers also stop at the model's end-of-text (EOS)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--nproc", type=int, help="processes to start (default: tp x pp)")
    gen.add_argument("--tp", type=int, default=1, help="split every layer over N processes (tensor parallel)")
    gen.add_argument("--pp", type=int, default=1, help="place the layers on N processes (pipeline stages)")
    gen.add_argument("--micro-batches", type=int, help="with --pp: requests in flight at once, in groups "
                                                       "(default: min(pp, prompts))")
    gen.add_argument("--dtype", choices=DTYPE_NAMES, help="compute dtype (default: the checkpoint's)")
    gen.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    gen.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may take")
    gen.add_argument("--timing", action="store_true",
                     help="print to stderr: time to the first token, answer tokens, tokens/s")


def add_bench_flags(bench) -> None:
    weights = bench.add_mutually_exclusive_group()
    weights.add_argument("--checkpoint", help="a checkpoint directory (or a save directory)")
    weights.add_argument("--model", help="a preset with random weights (seed 0), e.g. small")
    prompt = bench.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", action="append", help="text (repeatable; default: two Shakespeare openings)")
    prompt.add_argument("--prompt-ids", action="append", help="comma-separated ids (repeatable; default: 4 and 32 "
                                                              "random ids without a tokenizer)")
    bench.add_argument("--lengths", default="16,32,64,128", help="answer lengths in tokens, comma-separated")
    bench.add_argument("--runs", type=int, default=3, help="runs of each prompt and length")
    bench.add_argument("--batch", default="1", help="batch sizes, comma-separated (the prompt repeated)")
    bench.add_argument("--compare", action="store_true",
                       help="also run transformers' generate on the same weights, alternating run by run")
    bench.add_argument("--plot", help="PNG of latency against answer length, with the fitted lines")
    bench.add_argument("--json", action="store_true", help='print {"rows", "fits", "runs"}')
    bench.add_argument("--dtype", choices=DTYPE_NAMES, help="compute dtype (default: the checkpoint's)")
    bench.add_argument("--device", default="cpu", help="cpu | cuda")
    bench.add_argument("--threads", type=int, help="torch compute threads (default: torch's)")
