"""The `strata` command. Subcommands only parse, check and dispatch; the work lives elsewhere.

Bad input ends in one line on stderr (`strata: error: ...`) and exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields

from strata.config import TrainConfig, load_toml, make_config
from strata.errors import CollectiveError, ConfigError, StrataError, as_flag
from strata.files import check_image_file, check_output_file
from strata.infer.flags import add_bench_flags as add_bench_generate_flags
from strata.infer.flags import add_flags as add_generate_flags
from strata.rules.devices import check_device
from strata.rules.layout import Layout, check_schedule
from strata.rules.schedules import MAX_SIMULATED_ACTIONS, SCHEDULES, build

TRAIN_HELP = {
    "model": "model preset (tiny, small, gpt2-124m, llama-7b, ...)",
    "data": "directory written by `strata data prepare`, or 'synthetic'",
    "seq_len": "tokens per sequence (default: the model's max_seq_len)",
    "dtype": "fp32 | fp64 | bf16 | fp16 (bf16, fp16: autocast with fp32 master weights; fp16 with loss scaling)",
    "loss_scale": "fp16: initial dynamic loss scale",
    "loss_scale_window": "fp16: good steps in a row before the loss scale doubles",
    "min_loss_scale": "fp16: gradients that overflow at this loss scale stop the run (exit code 1)",
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
    "tensorboard": "write TensorBoard event files into this directory (rank 0; needs the tensorboard package)",
    "run_dir": "one directory for the run: config.toml, metrics, TensorBoard events, loss plot, checkpoints, log "
               "(--metrics, --save, --tensorboard still win)",
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

    launch = sub.add_parser("launch", help="start this node's ranks of a multi-node job from a hostfile, "
                                           "or write an sbatch script for Slurm")
    launch.add_argument("--hostfile", help="DeepSpeed-style: one 'HOST slots=N' per line; the first is the master")
    launch.add_argument("--slurm-script", metavar="FILE", help="write an sbatch script for the command instead "
                                                               "(one srun task per rank)")
    launch.add_argument("--nodes", type=int, help="with --slurm-script: nodes of the job")
    launch.add_argument("--gpus-per-node", type=int, help="with --slurm-script: GPUs (ranks) per node")
    launch.add_argument("--socket-ifname", help="with --slurm-script: the network interface for gloo and NCCL "
                                                "(default: the one holding the master's address, found in the job)")
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
    except CollectiveError as e:  # the run failed (not the input): one line, and the launcher is told who hung
        from strata.distributed.launch import report_failure
        print(f"strata: error: {e}", file=sys.stderr)
        report_failure(e)
        return 1
    except ConfigError as e:  # a field, named as the flag that sets it
        print(f"strata: error: {e.render(as_flag)}", file=sys.stderr)
        return 2
    except StrataError as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("strata: interrupted", file=sys.stderr)
        return 130


# Files a command writes, by command: (flag, is a picture). Checked before any work, so a typo in
# a directory costs one line, not a finished computation.
OUTPUT_FILES = {"plan": ("chart", True), "plot": ("out", True), "schedule": ("out", True), "bench": ("plot", True),
                "calibrate": ("out", False)}


def _check_outputs(args) -> None:
    name, picture = OUTPUT_FILES.get(args.command, (None, False))
    if name is not None and getattr(args, name, None) is not None:
        (check_image_file if picture else check_output_file)(getattr(args, name), name)


def _dispatch(args, argv) -> int:
    _check_outputs(args)
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
        return _launch(args)
    if args.command == "doctor":
        from strata.distributed.doctor import run
        _check_doctor_flags(args)
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
            check_device(args.device)
            calibrate.calibrate_inference(args.device, args.out or default_profile_path())
            return 0
        most = CALIBRATE_PROCESSES_PER_CORE * len(os.sched_getaffinity(0))
        if not 1 <= args.nproc <= most:
            raise ConfigError(f"--nproc {args.nproc}: must be between 1 and {most} ({CALIBRATE_PROCESSES_PER_CORE} "
                              f"processes per core of this machine)")
        if args.model not in PRESETS:
            raise ConfigError(f"--model {args.model}: unknown preset; valid: {', '.join(PRESETS)}")
        calibrate.calibrate(args.nproc, args.model, args.out or default_profile_path())
        return 0
    if args.command == "plot":
        if not os.path.isfile(args.metrics):
            raise ConfigError(f"{args.metrics}: {'is a directory' if os.path.isdir(args.metrics) else 'no such file'}; "
                              f"want a metrics file (--metrics) or a pipeline trace (--trace)")
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


def _check_doctor_flags(args) -> None:
    """The planned job's flags go with --bandwidth, and are checked as `strata plan` checks them."""
    from strata.distributed.commbench import parse_size
    from strata.plan.hardware import DEVICES
    try:
        args.bandwidth_bytes = parse_size(args.bandwidth_bytes)
    except ValueError as e:
        raise ConfigError(f"--bandwidth-bytes: {e}") from None
    planned = {"model": args.model, "layout": args.layout, "device": args.device != "A100-80G",
               "global_batch": args.global_batch != 8, "seq_len": args.seq_len, "precision": args.precision != "bf16"}
    given = [name for name, value in planned.items() if value]
    if given and not args.bandwidth:
        raise ConfigError(f"--{given[0].replace('_', '-')}: only with --bandwidth (the planned layout is checked "
                          f"against the measured link)")
    if args.device not in DEVICES:
        raise ConfigError(f"--device {args.device}: valid: {', '.join(DEVICES)}")
    if args.global_batch < 1:
        raise ConfigError(f"--global-batch {args.global_batch}: must be >= 1")


LAUNCHED_COMMANDS = ("train", "doctor", "bench")
# `strata calibrate` measures groups of up to --nproc processes sharing this machine's cores; past a
# few per core it only measures the scheduler.
CALIBRATE_PROCESSES_PER_CORE = 4  # what runs on the ranks of a multi-node job


def _launch(args) -> int:
    """Every check of the command the nodes will run, made here, before torchrun starts them."""
    from strata.distributed.hostfile import parse_hostfile
    from strata.distributed.launch import launch_hostfile
    command = args.strata_args[1:] if args.strata_args[:1] == ["--"] else args.strata_args
    if not 1 <= args.master_port <= 65535:
        raise ConfigError(f"--master-port {args.master_port}: valid 1-65535")
    if not command:
        raise ConfigError("strata launch: give the strata command to run after the flags, e.g. "
                          "`strata launch --hostfile hosts -- train --model small`")
    launched = build_parser().parse_args(command)
    from strata import cli_slurm
    if args.slurm_script is not None:
        return cli_slurm.write_script(args, launched, command, _checked_train)
    cli_slurm.check_hostfile_flags(args)
    if launched.command not in LAUNCHED_COMMANDS or (launched.command == "bench" and launched.bench_command != "comm"):
        raise ConfigError(f"strata launch -- {command[0]}: runs train, doctor or bench comm on every node")
    hosts = parse_hostfile(args.hostfile)
    if launched.command == "train":
        _checked_train(launched, command, len(hosts) * hosts[0].slots, in_a_rank=False)
    if launched.command == "doctor":
        _check_doctor_flags(launched)
    return launch_hostfile(args.hostfile, command, args.master_port, args.node_rank, args.dry_run,
                           env=ranks_checked() if launched.command == "train" else None)


def _bench_comm(args, argv) -> int:
    from strata.distributed.commbench import OPS, parse_size, run
    try:
        args.min_bytes, args.max_bytes = parse_size(args.min_bytes), parse_size(args.max_bytes)
    except ValueError as e:
        raise ConfigError(f"--min-bytes/--max-bytes: {e}") from None
    args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    bad = [op for op in args.ops if op not in OPS]
    checks = [(args.ops, f"--ops {','.join(args.ops)!r}: give at least one of {', '.join(OPS)}"),
              (not bad, f"--ops {','.join(bad)}: valid: {', '.join(OPS)}"),
              (args.tp >= 1 and args.pp >= 1, f"--tp {args.tp}, --pp {args.pp}: must be >= 1"),
              (0 < args.timeout < float("inf"), f"--timeout {args.timeout}: must be > 0 seconds"),
              (args.min_bytes <= args.max_bytes, f"--min-bytes {args.min_bytes} is above --max-bytes {args.max_bytes}"),
              (args.factor >= 2, f"--factor {args.factor}: must be >= 2"),
              (args.iters >= 1, f"--iters {args.iters}: must be >= 1"),
              (args.nproc >= 2, f"--nproc {args.nproc}: a collective needs 2 or more ranks"),
              (args.dim in (None, "dp", "tp", "pp"), f"--dim {args.dim}: valid: dp, tp, pp"),
              (min(args.tp, args.pp) < 1 or args.nproc % (args.tp * args.pp) == 0,
               f"--tp {args.tp} x --pp {args.pp} does not divide --nproc {args.nproc}")]
    if args.dim and not bad and args.tp >= 1 and args.pp >= 1 and args.nproc % (args.tp * args.pp) == 0:
        size = {"tp": args.tp, "pp": args.pp, "dp": args.nproc // (args.tp * args.pp)}.get(args.dim, 2)
        checks.append((size >= 2, f"--dim {args.dim}: its groups have {size} rank; set --{args.dim} 2 or more"
                                  if args.dim != "dp" else f"--dim dp: dp is 1 with --tp {args.tp} --pp {args.pp}"))
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    check_device(args.device)
    if "LOCAL_RANK" not in os.environ:
        from strata.distributed.launch import launch_local
        return launch_local(args.nproc, argv)
    return run(args)


def _schedule(args) -> int:
    from strata.parallel.pipeline.timeline import idle_fractions, plot_schedule, simulated
    for name in ("pp", "micro_batches", "virtual_stages"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    check_schedule(Layout(pp=args.pp, virtual_stages=args.virtual_stages, schedule=args.schedule))
    actions = 3 * args.pp * args.virtual_stages * args.micro_batches
    if actions > MAX_SIMULATED_ACTIONS:
        raise ConfigError(f"--pp {args.pp} x --virtual-stages {args.virtual_stages} x --micro-batches "
                          f"{args.micro_batches}: about {actions:,} actions, more than the {MAX_SIMULATED_ACTIONS:,} "
                          f"simulated here")
    spec = SCHEDULES[args.schedule]
    v = args.virtual_stages
    # unit costs per stage: F 1, B 2 (split 1 + 1 under zero-bubble); a chunk does 1/v of a stage
    cost = {"F": 1 / v, "B": (1 if spec.splits_backward else 2) / v, "W": 1 / v}
    ranks = simulated(build(args.schedule, args.pp, args.micro_batches, v), args.pp * v, cost)
    idle = idle_fractions(ranks)
    print(f"{args.schedule}, pp {args.pp}, {args.micro_batches} micro-batches, virtual stages {v}: idle per rank "
          f"{', '.join(f'{x:.3f}' for x in idle)} (gpipe/1f1b theory {(args.pp - 1) / (args.micro_batches + args.pp - 1):.3f})")
    if args.out:
        plot_schedule(ranks, args.out, f"simulated {args.schedule}")
        print(f"wrote {args.out}")
    return 0


def _checked_train(args, argv: list[str], world_size: int | None, in_a_rank: bool) -> tuple[TrainConfig, list[str]]:
    """The run's config, every setting and file checked (in the process that starts the ranks, so
    a problem is one line), and the argv the ranks get (with --parallel auto's choice). The world
    size is the launched one, or --nproc's."""
    from strata.train.preflight import DONE, checked_model, model_shape, preflight
    flag_values = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}
    cfg = make_config(load_toml(args.config) if args.config else {}, flag_values)
    world_size = world_size or cfg.nproc
    checked_already = DONE in os.environ
    if cfg.parallel == "auto":
        from strata.config import check_run_settings
        from strata.plan.auto import as_flags, choose
        check_run_settings(cfg)
        cfg, reasons = choose(cfg, world_size, model_shape(cfg))
        if int(os.environ.get("RANK", 0)) == 0 and not checked_already:
            print("\n".join(reasons), file=sys.stderr, flush=True)
        argv = [*argv, *as_flags(cfg)]
    checked_model(cfg, world_size)
    if not in_a_rank:  # the files, once; the ranks are told so (ranks_checked() in their environment)
        for note in preflight(cfg):
            print(note, file=sys.stderr, flush=True)
    return cfg, argv


def ranks_checked() -> dict[str, str]:
    """What the launcher adds to the ranks' environment once it has checked the run's files."""
    from strata.train.preflight import DONE
    return {DONE: "1"}


def _train(args, argv) -> int:
    argv = ["train", *argv[1:]] if argv[:1] == ["train"] else argv
    from strata.distributed.slurm import started_by_srun
    if started_by_srun():  # a task of srun: its node's ranks run, or it becomes a rank (strata/cli_slurm.py)
        from strata.cli_slurm import join_job
        exit_code = join_job(args, argv, _checked_train)
        if exit_code is not None:
            return exit_code
    launched_by_torchrun = "LOCAL_RANK" in os.environ
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if launched_by_torchrun else None
    cfg, argv = _checked_train(args, argv, world_size, launched_by_torchrun)
    if cfg.nproc > 1 and not launched_by_torchrun:
        from strata.distributed.launch import launch_local
        return launch_local(cfg.nproc, argv, cfg.max_restarts, env=ranks_checked())
    from strata.train.trainer import train
    try:
        summary = train(cfg, checked=not launched_by_torchrun)
    except FloatingPointError as e:  # reported, not a traceback: the checkpoints written so far are intact
        if int(os.environ.get("RANK", 0)) == 0:  # every rank stops alike: one line says it
            print(f"strata: error: {e}", file=sys.stderr)
        return 1
    if summary["val_losses"] and int(os.environ.get("RANK", 0)) == 0:
        first, last = summary["val_losses"][0], summary["val_losses"][-1]
        print(f"validation loss: {first[1]:.4f} at step {first[0]} -> {last[1]:.4f} at step {last[0]}")
        if summary["checkpoint"]:
            print(f"checkpoint: {summary['checkpoint']}")
    return 0
