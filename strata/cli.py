"""The `strata` command. Subcommands only parse, check and dispatch; the work lives elsewhere.

Bad input ends in one line on stderr (`strata: error: ...`) and exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields

from strata.config import ConfigError, TrainConfig, load_toml, make_config, validate

TRAIN_HELP = {
    "model": "model preset (tiny, small, gpt2-124m, llama-7b, ...)",
    "data": "directory written by `strata data prepare`, or 'synthetic'",
    "seq_len": "tokens per sequence (default: the model's max_seq_len)",
    "dtype": "fp32 | fp64 | bf16 (bf16: autocast with fp32 master weights)",
    "micro_batch": "sequences per forward/backward on one rank",
    "global_batch": "sequences per optimizer step, all ranks together",
    "nproc": "start N local processes (through torch.distributed.run)",
    "dp": "data-parallel degree (default: world / (tp x pp))",
    "tp": "tensor-parallel degree", "pp": "pipeline-parallel degree", "zero": "ZeRO stage 0-3",
    "sequence_parallel": "with --tp: split norms and residuals along the sequence too",
    "vocab_size": "synthetic data: vocabulary size (default: the preset's)",
    "timeout": "seconds a collective may take before it fails",
    "eval_every": "validate every N steps (0: only at the start and the end)",
    "metrics": "write one JSON object per step to this file (rank 0)",
    "save": "save checkpoints under this directory", "save_every": "save every N steps (0: at the end)",
    "resume": "resume from a checkpoint (or a save directory: its latest)",
    "peak_flops": "peak FLOP/s per device for MFU (default: a matmul measured once, cached)",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's default prints the usage too)
        raise ConfigError(f"{message} (see `{self.prog} --help`)")


def _add_train_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file with the same keys as the flags")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":  # a flag that flips the default
            on = f.default is False
            parser.add_argument(flag if on else f"--no-{f.name.replace('_', '-')}", dest=f.name,
                                action="store_const", const=on, default=None,
                                help=TRAIN_HELP.get(f.name, f"turn off {f.name}"))
            continue
        kind = {"int": int, "float": float}.get(f.type.split(" ")[0], str)
        default = "" if f.default is None else f" (default: {f.default})"
        parser.add_argument(flag, type=kind, default=None, help=f"{TRAIN_HELP.get(f.name, '')}{default}".strip())


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="strata", description="Train large language models across many devices.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    _add_train_flags(sub.add_parser("train", help="train a model"))

    data = sub.add_parser("data", help="prepare training data")
    data_sub = data.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    prep = data_sub.add_parser("prepare", help="text -> tokenizer + token shards")
    prep.add_argument("--source", nargs="+", default=["shakespeare"],
                      help="'shakespeare', text files or directories of .txt files")
    prep.add_argument("--tokenizer", default="bpe:8192", help="bpe:N to train one, or a tokenizer.json")
    prep.add_argument("--out", required=True, help="output directory")
    prep.add_argument("--val-fraction", type=float, default=0.05)

    gen = sub.add_parser("generate", help="sample from a checkpoint")
    gen.add_argument("--checkpoint", required=True)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text (needs the tokenizer saved with the checkpoint)")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    gen.add_argument("--max-new-tokens", type=int, default=100)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--tp", type=int, default=1, help="split the model over N processes (tensor parallel)")

    plot = sub.add_parser("plot", help="draw the loss curve of a metrics file")
    plot.add_argument("metrics")
    plot.add_argument("--out", required=True, help="PNG file")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser().parse_args(argv)
        return _dispatch(args, argv)
    except ConfigError as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("strata: interrupted", file=sys.stderr)
        return 130


def _dispatch(args, argv) -> int:
    if args.command == "train":
        return _train(args, argv)
    if args.command == "data":
        from strata.data.prepare import prepare
        meta = prepare(args.source, args.out, args.tokenizer, args.val_fraction)
        print(f"wrote {args.out}: vocab {meta['vocab_size']}, train {meta['splits']['train']['tokens']:,} "
              f"tokens, val {meta['splits']['val']['tokens']:,} tokens")
        return 0
    if args.command == "generate":
        from strata.infer.cli import run_generate
        return run_generate(args, argv)
    if args.command == "plot":
        from strata.train.plot import plot_losses
        plot_losses(args.metrics, args.out)
        print(f"wrote {args.out}")
        return 0
    raise AssertionError(args.command)


def _train(args, argv) -> int:
    flag_values = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}
    cfg = make_config(load_toml(args.config) if args.config else {}, flag_values)
    launched_by_torchrun = "LOCAL_RANK" in os.environ
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if launched_by_torchrun else cfg.nproc
    validate(cfg, world_size)  # before any process exists
    if cfg.nproc > 1 and not launched_by_torchrun:
        from strata.distributed.launch import launch_local
        return launch_local(cfg.nproc, ["train", *argv[1:]] if argv[:1] == ["train"] else argv)
    from strata.train.trainer import train
    summary = train(cfg)
    if summary["val_losses"] and int(os.environ.get("RANK", 0)) == 0:
        first, last = summary["val_losses"][0], summary["val_losses"][-1]
        print(f"validation loss: {first[1]:.4f} at step {first[0]} -> {last[1]:.4f} at step {last[0]}")
        if summary["checkpoint"]:
            print(f"checkpoint: {summary['checkpoint']}")
    return 0
