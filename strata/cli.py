"""The `strata` command. Subcommands only parse, check and dispatch; the work lives elsewhere.

Bad input ends in one line on stderr (`strata: error: ...`) and exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields

from strata.config import ConfigError, TrainConfig, load_toml, make_config, validate
from strata.infer.flags import add_bench_flags as add_bench_generate_flags
from strata.infer.flags import add_flags as add_generate_flags

TRAIN_HELP = {
    "model": "model preset (tiny, small, gpt2-124m, llama-7b, ...)",
    "data": "directory written by `strata data prepare`, or 'synthetic'",
    "seq_len": "tokens per sequence (default: the model's max_seq_len)",
    "dtype": "fp32 | fp64 | bf16 | fp16 (bf16, fp16: autocast with fp32 master weights; fp16 with loss scaling)",
    "loss_scale": "fp16: initial dynamic loss scale",
    "loss_scale_window": "fp16: good steps in a row before the loss scale doubles",
    "micro_batch": "sequences per forward/backward on one rank",
    "global_batch": "sequences per optimizer step, all ranks together",
    "nproc": "start N local processes (through torch.distributed.run)",
    "parallel": "manual: the layout flags; auto: the planner chooses dp, tp, pp, ZeRO, micro-batch, schedule, checkpointing",
    "dp": "data-parallel degree (default: world / (tp x pp))",
    "tp": "tensor-parallel degree", "pp": "pipeline-parallel degree (stages)", "zero": "ZeRO stage 0-3",
    "n_layers": "override the preset's number of transformer blocks",
    "schedule": "pipeline schedule: gpipe | 1f1b | interleaved | zb (zero-bubble ZB-H1)",
    "virtual_stages": "with --schedule interleaved: model chunks per pipeline rank",
    "pp_split": "blocks per pipeline chunk, e.g. 3,5 (default: balanced by FLOPs)",
    "checkpointing": "activation checkpointing: none | full | selective | every:K (first K blocks of each chunk)",
    "offload": "none | cpu | disk: optimizer step in host memory (cpu), or Adam's moments in a file (disk)",
    "offload_dir": "with --offload disk: where the moment files go (default: the temp directory)",
    "reduce_dtype": "dtype of the data-parallel gradient reduction: fp32 (the master gradients') or bf16 (half the bytes)",
    "trace": "write the last step's pipeline timeline as a Chrome/Perfetto trace (JSON)",
    "sequence_parallel": "with --tp: split norms and residuals along the sequence too",
    "vocab_size": "synthetic data: vocabulary size (default: the preset's)",
    "timeout": "seconds a collective may take before it fails",
    "eval_every": "validate every N steps (0: only at the start and the end)",
    "metrics": "write one JSON object per step to this file (rank 0)",
    "save": "save checkpoints under this directory", "save_every": "save every N steps (0: at the end)",
    "resume": "resume from a checkpoint, a save directory (its latest), or 'auto' (--save's latest, if any)",
    "keep": "keep only the newest N checkpoints (0: all)",
    "async_save": "write checkpoints in the background while training continues",
    "init_from": "start from a checkpoint's weights and model shape (any layout; step 0, fresh optimizer)",
    "max_restarts": "with --nproc: when a rank fails, restart all and resume from the latest checkpoint, up to N times",
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

    add_generate_flags(sub.add_parser("generate", help="sample from a checkpoint: one process, --tp N, --pp N"))

    conv = sub.add_parser("convert", help="Hugging Face <-> strata checkpoints (LLaMA and GPT-2 families)")
    direction = conv.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="DIR", help="a local Hugging Face model (config.json + safetensors)")
    direction.add_argument("--to-hf", metavar="CKPT", help="a strata checkpoint (or save directory), any layout")
    conv.add_argument("--out", required=True, help="the strata checkpoint directory, or the Hugging Face one")

    plan = sub.add_parser("plan", help="choose the layout for a model on a cluster: memory, communication, time")
    plan.add_argument("--model", required=True, help="a preset, a strata checkpoint, or a Hugging Face config.json")
    plan.add_argument("--device", default="A100-80G", help="A100-80G, H100-80G, V100-32G, ... or cpu-local (calibrated)")
    plan.add_argument("--nodes", type=int, default=1)
    plan.add_argument("--gpus-per-node", type=int, default=8, help="devices per node (cpu-local: processes)")
    plan.add_argument("--intra", help="link inside a node: nvlink | pcie | GB/s (default: nvlink if the device has it)")
    plan.add_argument("--network", default="ib-200", help="between nodes: 10gbe | 100gbe | ib-200 | ib-400 | GB/s")
    plan.add_argument("--nics-per-node", type=int, default=1, help="network links per node (8 on a DGX A100)")
    plan.add_argument("--global-batch", type=int, default=512, help="sequences per optimizer step")
    plan.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's context)")
    plan.add_argument("--precision", default="bf16", help="bf16 | fp16 (mixed precision, 16 bytes/parameter) | fp32")
    plan.add_argument("--optimizer", default="adamw", help="adamw (two fp32 moments) | sgd (with momentum: one)")
    plan.add_argument("--layout", help="evaluate one layout instead of searching, e.g. dp=8,tp=8,pp=16,zero=1,mb=1,ckpt=full")
    plan.add_argument("--top", type=int, default=10, help="layouts to show")
    plan.add_argument("--json", action="store_true", help='print {"layouts": [...]}, best first')
    plan.add_argument("--explain", action="store_true", help="why the best layout wins and the others lose")
    plan.add_argument("--chart", help="PNG of the memory breakdown of the layouts shown")
    plan.add_argument("--no-offload", action="store_true", help="leave optimizer offload out of the search")
    plan.add_argument("--profile", help="calibration profile for cpu-local (default: the one `strata calibrate` wrote)")
    plan.add_argument("--inference", action="store_true",
                      help="serving instead of training: weights + KV cache, and the time per output token, per tp x pp")
    plan.add_argument("--batch", type=int, default=1, help="--inference: sequences decoded together")
    plan.add_argument("--context", type=int, help="--inference: tokens per sequence so far, prompt + answer "
                                                  "(default: the model's context)")
    plan.add_argument("--per-layer-us", type=float, help="--inference: overhead per layer and token "
                                                         "(default: calibrated, else 60)")
    plan.add_argument("--per-token-us", type=float, help="--inference: overhead per token (default: calibrated, else 200)")
    plan.add_argument("--efficiency", type=float, help="fraction of peak FLOP/s the compute reaches (default 0.63; cpu-local: calibrated)")

    bench = sub.add_parser("bench", help="benchmarks: collectives, generation latency")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, parser_class=_Parser)
    bc = bench_sub.add_parser("comm", help="collective bandwidth per operation and size, like nccl-tests")
    bc.add_argument("--nproc", type=int, default=2, help="start N local ranks (not under torchrun)")
    bc.add_argument("--ops", default=",".join(("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all",
                                               "sendrecv")), help="comma-separated operations")
    bc.add_argument("--min-bytes", default="1K", help="smallest message, e.g. 1K")
    bc.add_argument("--max-bytes", default="64M", help="largest message, e.g. 64M")
    bc.add_argument("--factor", type=int, default=4, help="size step between messages")
    bc.add_argument("--iters", type=int, default=10, help="calls timed per size")
    bc.add_argument("--dim", help="run on one mesh dimension's groups: dp | tp | pp (with --tp/--pp)")
    bc.add_argument("--tp", type=int, default=1)
    bc.add_argument("--pp", type=int, default=1)
    bc.add_argument("--device", default="auto", help="auto | cpu | cuda")
    bc.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may take")
    bc.add_argument("--json", action="store_true", help='print {"rows": [...]}')

    add_bench_generate_flags(bench_sub.add_parser("generate", help="generation latency against answer length "
                                                                   "(TTFT, TPOT, a fit, a plot; --compare with transformers)"))

    launch = sub.add_parser("launch", help="start this node's ranks of a multi-node job from a hostfile")
    launch.add_argument("--hostfile", required=True, help="DeepSpeed-style: one 'HOST slots=N' per line; the first is the master")
    launch.add_argument("--master-port", type=int, default=29500)
    launch.add_argument("--node-rank", type=int, help="this node's rank (default: found from its addresses)")
    launch.add_argument("--dry-run", action="store_true", help="print the torchrun command instead of running it")
    launch.add_argument("strata_args", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                        help="the strata command to run, e.g. -- train --model small")

    doc = sub.add_parser("doctor", help="check this node (and a hostfile's) for what breaks multi-node training")
    doc.add_argument("--hostfile", help="check every host: resolves, not loopback, reachable; and the socket interface")
    doc.add_argument("--bandwidth", action="store_true",
                     help="(launched on every node) measure the inter-node bandwidth and check the planned layout")
    doc.add_argument("--bandwidth-bytes", default="16M", help="all-reduce size for --bandwidth")
    doc.add_argument("--model", help="with --bandwidth: the model the job will train (preset, checkpoint, config.json)")
    doc.add_argument("--layout", help="with --bandwidth: the planned layout, e.g. dp=2 (default: data parallel)")
    doc.add_argument("--device", default="A100-80G", help="the planned job's device (from the planner's table)")
    doc.add_argument("--global-batch", type=int, default=8)
    doc.add_argument("--seq-len", type=int)
    doc.add_argument("--precision", default="bf16")

    cal = sub.add_parser("calibrate", help="measure this machine for the planner's cpu-local device")
    cal.add_argument("--nproc", type=int, default=4, help="measure groups of 1, 2, 4, ... up to N processes")
    cal.add_argument("--model", default="small", help="the preset whose training step sets the efficiency")
    cal.add_argument("--out", help="profile file (default: ~/.cache/strata/calibration.json)")
    cal.add_argument("--inference", action="store_true",
                     help="measure what `plan --inference` needs instead: memory bandwidth and decode overheads")
    cal.add_argument("--device", default="cpu", help="with --inference: cpu | cuda | auto")
    cal.add_argument("--worker", help=argparse.SUPPRESS)

    plot = sub.add_parser("plot", help="draw the loss curve of a metrics file, or a pipeline trace")
    plot.add_argument("metrics", help="metrics JSONL (--metrics) or pipeline trace JSON (--trace)")
    plot.add_argument("--out", required=True, help="PNG file")

    sched = sub.add_parser("schedule", help="simulate a pipeline schedule: bubble per rank, and a picture")
    sched.add_argument("--schedule", default="1f1b", help="gpipe | 1f1b | interleaved | zb")
    sched.add_argument("--pp", type=int, default=4, help="pipeline stages")
    sched.add_argument("--micro-batches", type=int, default=8)
    sched.add_argument("--virtual-stages", type=int, default=1, help="chunks per rank (interleaved)")
    sched.add_argument("--out", help="PNG file")
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
    if args.command == "convert":
        from strata.checkpoint.hf import convert_from_hf, convert_to_hf
        source = args.from_hf or args.to_hf
        if not os.path.isdir(source):
            raise ConfigError(f"--{'from-hf' if args.from_hf else 'to-hf'} {source}: no such directory")
        written = convert_from_hf(args.from_hf, args.out) if args.from_hf else convert_to_hf(args.to_hf, args.out)
        print(f"wrote {written}")
        return 0
    if args.command == "plan":
        from strata.plan.report import run_plan
        if args.top < 1:
            raise ConfigError(f"--top {args.top}: must be >= 1")
        if args.inference:
            from strata.plan.report import run_serving_plan
            return run_serving_plan(args)
        return run_plan(args)
    if args.command == "launch":
        from strata.distributed.hostfile import launch
        command = args.strata_args[1:] if args.strata_args[:1] == ["--"] else args.strata_args
        return launch(args.hostfile, command, args.master_port, args.node_rank, args.dry_run)
    if args.command == "doctor":
        from strata.distributed.commbench import parse_size
        from strata.distributed.doctor import run
        try:
            args.bandwidth_bytes = parse_size(args.bandwidth_bytes)
        except ValueError as e:
            raise ConfigError(f"--bandwidth-bytes: {e}") from None
        if args.model and not args.bandwidth:
            raise ConfigError("--model: only with --bandwidth (the planned layout is checked against the measured link)")
        if args.bandwidth and "LOCAL_RANK" not in os.environ:
            raise ConfigError("--bandwidth: run it on every node through `strata launch --hostfile H -- doctor --bandwidth`")
        return run(args)
    if args.command == "bench" and args.bench_command == "generate":
        from strata.infer.bench import run_bench
        return run_bench(args)
    if args.command == "bench":
        return _bench_comm(args, argv)
    if args.command == "calibrate":
        from strata.plan import calibrate
        if args.worker:
            calibrate.worker(args.worker)
            return 0
        from strata.model.presets import PRESETS
        from strata.plan.inputs import default_profile_path
        if args.inference:
            if args.device not in ("cpu", "cuda", "auto"):
                raise ConfigError(f"--device {args.device}: valid: cpu, cuda, auto")
            calibrate.calibrate_inference(args.device, args.out or default_profile_path())
            return 0
        if args.nproc < 1:
            raise ConfigError(f"--nproc {args.nproc}: must be >= 1")
        if args.model not in PRESETS:
            raise ConfigError(f"--model {args.model}: unknown preset; valid: {', '.join(PRESETS)}")
        calibrate.calibrate(args.nproc, args.model, args.out or default_profile_path())
        return 0
    if args.command == "plot":
        from strata.parallel.pipeline.timeline import is_trace, plot_schedule, read_trace
        from strata.train.plot import plot_losses
        if is_trace(args.metrics):
            plot_schedule(read_trace(args.metrics), args.out, os.path.basename(args.metrics))
        else:
            plot_losses(args.metrics, args.out)
        print(f"wrote {args.out}")
        return 0
    if args.command == "schedule":
        return _schedule(args)
    raise AssertionError(args.command)


def _bench_comm(args, argv) -> int:
    from strata.distributed.commbench import OPS, parse_size, run
    try:
        args.min_bytes, args.max_bytes = parse_size(args.min_bytes), parse_size(args.max_bytes)
    except ValueError as e:
        raise ConfigError(f"--min-bytes/--max-bytes: {e}") from None
    args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    bad = [op for op in args.ops if op not in OPS]
    checks = [(not bad, f"--ops {','.join(bad)}: valid: {', '.join(OPS)}"),
              (args.min_bytes <= args.max_bytes, f"--min-bytes {args.min_bytes} is above --max-bytes {args.max_bytes}"),
              (args.factor >= 2, f"--factor {args.factor}: must be >= 2"),
              (args.iters >= 1, f"--iters {args.iters}: must be >= 1"),
              (args.nproc >= 2, f"--nproc {args.nproc}: a collective needs 2 or more ranks"),
              (args.dim in (None, "dp", "tp", "pp"), f"--dim {args.dim}: valid: dp, tp, pp"),
              (args.nproc % (args.tp * args.pp) == 0,
               f"--tp {args.tp} x --pp {args.pp} does not divide --nproc {args.nproc}")]
    if args.dim and not bad and args.nproc % (args.tp * args.pp) == 0:
        size = {"tp": args.tp, "pp": args.pp, "dp": args.nproc // (args.tp * args.pp)}.get(args.dim, 2)
        checks.append((size >= 2, f"--dim {args.dim}: its groups have {size} rank; set --{args.dim} 2 or more"
                                  if args.dim != "dp" else f"--dim dp: dp is 1 with --tp {args.tp} --pp {args.pp}"))
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    if "LOCAL_RANK" not in os.environ:
        from strata.distributed.launch import launch_local
        return launch_local(args.nproc, argv)
    return run(args)


def _schedule(args) -> int:
    from strata.parallel.pipeline.schedules import SCHEDULES, build
    from strata.parallel.pipeline.timeline import idle_fractions, plot_schedule, simulated
    if args.schedule not in SCHEDULES:
        raise ConfigError(f"--schedule {args.schedule}: valid: {', '.join(SCHEDULES)}")
    for name in ("pp", "micro_batches", "virtual_stages"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    v = args.virtual_stages if args.schedule == "interleaved" else 1
    # unit costs per stage: F 1, B 2 (split 1 + 1 under zero-bubble); a chunk does 1/v of a stage
    cost = {"F": 1 / v, "B": (1 if args.schedule == "zb" else 2) / v, "W": 1 / v}
    ranks = simulated(build(args.schedule, args.pp, args.micro_batches, v), args.pp * v, cost)
    idle = idle_fractions(ranks)
    print(f"{args.schedule}, pp {args.pp}, {args.micro_batches} micro-batches, virtual stages {v}: idle per rank "
          f"{', '.join(f'{x:.3f}' for x in idle)} (gpipe/1f1b theory {(args.pp - 1) / (args.micro_batches + args.pp - 1):.3f})")
    if args.out:
        plot_schedule(ranks, args.out, f"simulated {args.schedule}")
        print(f"wrote {args.out}")
    return 0


def _train(args, argv) -> int:
    flag_values = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}
    cfg = make_config(load_toml(args.config) if args.config else {}, flag_values)
    launched_by_torchrun = "LOCAL_RANK" in os.environ
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if launched_by_torchrun else cfg.nproc
    argv = ["train", *argv[1:]] if argv[:1] == ["train"] else argv
    if cfg.parallel == "auto":
        from strata.config import check_checkpoint_flags, model_shape
        from strata.plan.auto import as_flags, choose
        check_checkpoint_flags(cfg)
        cfg, reasons = choose(cfg, world_size, model_shape(cfg))
        if int(os.environ.get("RANK", 0)) == 0:
            print("\n".join(reasons), file=sys.stderr, flush=True)
        argv = [*argv, *as_flags(cfg)]
    validate(cfg, world_size)  # before any process exists
    if cfg.nproc > 1 and not launched_by_torchrun:
        from strata.distributed.launch import launch_local
        return launch_local(cfg.nproc, argv, cfg.max_restarts)
    from strata.train.trainer import train
    try:
        summary = train(cfg)
    except FloatingPointError as e:  # reported, not a traceback: the checkpoints written so far are intact
        print(f"strata: error: {e}", file=sys.stderr)
        return 1
    if summary["val_losses"] and int(os.environ.get("RANK", 0)) == 0:
        first, last = summary["val_losses"][0], summary["val_losses"][-1]
        print(f"validation loss: {first[1]:.4f} at step {first[0]} -> {last[1]:.4f} at step {last[0]}")
        if summary["checkpoint"]:
            print(f"checkpoint: {summary['checkpoint']}")
    return 0
